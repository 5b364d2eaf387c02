"""An S3 service for tests: moto's server mode, in this process, on a free port.

``moto_s3_server()`` yields the endpoint URL; ``new_bucket(endpoint)`` creates a bucket of its own
for one test. Credentials are moto's dummies, set in the environment by :func:`aws_test_env` so
boto3's standard chain finds them (and never a developer's real ones).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator

AWS_TEST_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_SESSION_TOKEN": "testing"}


def aws_test_env(monkeypatch) -> None:
    """Point boto3's credential chain at moto's dummy credentials for this test."""
    for name, value in AWS_TEST_ENV.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


@contextlib.contextmanager
def moto_s3_server() -> Iterator[str]:
    """Run ``moto.server.ThreadedMotoServer`` on 127.0.0.1 and a port the OS picks; yields
    ``http://127.0.0.1:PORT``."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def s3_client(endpoint: str):
    """A plain boto3 S3 client on ``endpoint`` (to look behind a store's back)."""
    import boto3

    return boto3.session.Session(
        aws_access_key_id=AWS_TEST_ENV["AWS_ACCESS_KEY_ID"], aws_secret_access_key=AWS_TEST_ENV["AWS_SECRET_ACCESS_KEY"],
        aws_session_token=AWS_TEST_ENV["AWS_SESSION_TOKEN"], region_name=AWS_TEST_ENV["AWS_DEFAULT_REGION"],
    ).client("s3", endpoint_url=endpoint)


def new_bucket(endpoint: str) -> str:
    """Create a bucket with a fresh name on ``endpoint``; returns its name."""
    name = f"backfill-test-{secrets.token_hex(6)}"
    s3_client(endpoint).create_bucket(Bucket=name)
    return name


def multipart_uploads(endpoint: str, bucket: str) -> list[dict]:
    """The multipart uploads still open in ``bucket`` (``[]`` when none)."""
    return s3_client(endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads", [])
