# The backfill image: one image, every service (`backfill gateway|worker|beat|processor|router|
# migrate|engine-sim …`). Build from the repository root:
#   docker build -t backfill:dev .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    BACKFILL_DATA_DIR=/data

# a fixed non-root user; the Kubernetes manifests run as uid/gid 10001 too
RUN groupadd --system --gid 10001 backfill \
 && useradd --system --uid 10001 --gid backfill --home-dir /home/backfill --create-home --shell /usr/sbin/nologin backfill \
 && mkdir -p /data && chown backfill:backfill /data

WORKDIR /src
COPY pyproject.toml README.md ./
COPY backfill ./backfill
COPY common ./common
COPY batch_gateway ./batch_gateway
COPY workers ./workers
COPY async_processor ./async_processor
COPY router ./router
COPY engine_twin ./engine_twin
COPY lab ./lab
COPY migrations ./migrations
# kubernetes: the router's engine discovery by label selector (--engine-selector) imports it;
# same bounds as the dev extra (37 needs python-dateutil>=3, which botocore refuses)
RUN pip install . "kubernetes>=31,<37" \
 && rm -rf /src \
 && backfill --help > /dev/null

WORKDIR /home/backfill
USER 10001:10001
EXPOSE 8000 8100 9090
ENTRYPOINT ["backfill"]
CMD ["--help"]
