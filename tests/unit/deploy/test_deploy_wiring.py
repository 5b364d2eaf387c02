"""deploy/k8s is wired to the code: engine command lines come from engine_twin/launch.py, every
router replica subscribes to every engine's bound KV-event and replay sockets, the router's
scheduling config is the shipped precise one with replicas as the router counts them, KEDA
watches the streams and subscriptions the processors read, and every BACKFILL_* variable is a
setting some service reads (and validates)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import DEPLOY, OVERLAYS, REPO, STORE_FALLBACK, settings_from, settings_under_env
from derived_configs import DERIVED

from async_processor.settings import ProcessorSettings
from batch_gateway.settings import GatewaySettings
from batch_gateway.store.files import build_file_store, storage_key
from common.contracts.queue import LANE_PRIORITIES, pubsub_request_topic, request_stream
from engine_twin.launch import VLLM_IMAGE, plugin_env, sim_engine_argv, vllm_engine_argv, vllm_engine_env
from router.scheduling.config import parse_config
from router.scheduling.plugins.prefix import PRECISE_PRODUCER_TYPE
from router.settings import RouterSettings
from workers.settings import WorkerSettings

CPU_OFFLOAD_BYTES = 32 << 30  # deploy/vllm/engine-args.yaml: the 32 GiB CPU KV tier
#: the first vLLM release known to read each kv_connector_extra_config key of the CPU KV tier
#: (vllm/v1/kv_offload/cpu.py at the versioned API docs, docs.vllm.ai/en/<tag>/api/vllm/v1/kv_offload/cpu:
#: v0.11.0 reads num_cpu_blocks only; v0.11.2 adds eviction_policy; v0.15.0 reads cpu_bytes_to_use in
#: place of num_cpu_blocks, vLLM pull request #24498; v0.12-v0.14 unchecked)
OFFLOAD_KEYS_SINCE = {"cpu_bytes_to_use": (0, 15, 0), "eviction_policy": (0, 11, 2)}
SETTINGS_BY_PREFIX = {"BACKFILL_PROCESSOR_": ProcessorSettings, "BACKFILL_ROUTER_": RouterSettings,
                      "BACKFILL_WORKER_": WorkerSettings, "BACKFILL_GATEWAY_": GatewaySettings}
SOURCE_DIRS = ("backfill", "common", "batch_gateway", "workers", "async_processor", "router", "engine_twin")


def find(objects, kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def container_of(objects, deployment: str) -> dict[str, Any]:
    return find(objects, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]


def env_of(objects, deployment: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps/Secrets in order,
    then env (literal values only)."""
    container = container_of(objects, deployment)
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef") or source.get("secretRef")
        kind = "ConfigMap" if "configMapRef" in source else "Secret"
        match = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == ref["name"]]
        if match:
            env.update(match[0].get("data") or match[0].get("stringData") or {})
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def engine_kv_ports(objects) -> tuple[int, int]:
    """The engine container's ``kv-events`` and ``kv-replay`` ports (it binds both)."""
    ports = {p["name"]: p["containerPort"] for p in container_of(objects, "backfill-vllm")["ports"]}
    return ports["kv-events"], ports["kv-replay"]


def engine_kv_endpoints(objects) -> tuple[str, str]:
    """``(tcp://*:<kv port>, tcp://*:<replay port>)``: what the engine binds."""
    kv, replay = engine_kv_ports(objects)
    return f"tcp://*:{kv}", f"tcp://*:{replay}"


@pytest.mark.parametrize("overlay", ["production", "pubsub"])
def test_vllm_command_is_the_launch_builders_output(rendered, overlay):
    objects = rendered[overlay]
    container = container_of(objects, "backfill-vllm")
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    kv, replay = engine_kv_endpoints(objects)
    expected = vllm_engine_argv("$(MODEL)", port, ["$(SERVED_MODEL_NAME)"], kv, host="$(POD_IP)", python="python3",
                                cpu_offload_bytes=CPU_OFFLOAD_BYTES, kv_events_replay_endpoint=replay, plugin=True)
    assert container["command"] + container["args"] == expected
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["PYTHONHASHSEED"]["value"] == vllm_engine_env(base={})["PYTHONHASHSEED"]
    assert {name: env[name]["value"] for name in plugin_env()} == plugin_env()
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_vllm_command_equals_engine_args_yaml(rendered):
    """deploy/vllm/engine-args.yaml and the Deployment are one command line: the engine binds its
    KV-event and replay sockets for routers that connect."""
    spec = yaml.safe_load((DEPLOY / "vllm" / "engine-args.yaml").read_text())
    container = container_of(rendered["production"], "backfill-vllm")
    assert container["command"] + container["args"] == spec["command"] + spec["args"]
    config = json.loads(container["args"][container["args"].index("--kv-events-config") + 1])
    assert (config["endpoint"], config["replay_endpoint"]) == engine_kv_endpoints(rendered["production"])


def test_dev_engines_are_simulators_with_the_launch_builders_args(rendered):
    objects = rendered["dev"]
    container = container_of(objects, "backfill-vllm")
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    kv, replay = engine_kv_endpoints(objects)
    expected = sim_engine_argv(port, ["$(SERVED_MODEL_NAME)"], kv, host="$(POD_IP)", kv_events_replay_endpoint=replay)
    assert container["command"] == ["backfill"] and container["args"] == expected[1:]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_router_replica_subscribes_to_every_engines_kv_sockets_and_discovers_them(rendered, overlay):
    objects = rendered[overlay]
    settings = settings_from(RouterSettings, "BACKFILL_ROUTER_", env_of(objects, "backfill-router"))
    router = container_of(objects, "backfill-router")
    # no bound socket (an engine's connection would reach one replica): each replica connects to
    # <pod ip>:<kv port> of every discovered engine, replay at kv port + offset
    assert settings.kv_events_bind is None and settings.kv_events
    kv, replay = engine_kv_ports(objects)
    assert settings.kv_events_port == kv and kv + settings.kv_events_replay_port_offset == replay
    assert "kv-events" not in {p["name"] for p in router["ports"]}
    assert settings.port in {p["containerPort"] for p in router["ports"]}
    key, _, value = settings.engine_selector.partition("=")
    engine = find(objects, "Deployment", "backfill-vllm")
    assert engine["spec"]["template"]["metadata"]["labels"][key] == value
    engine_ports = {p["containerPort"] for p in engine["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert settings.engine_port in engine_ports
    # the scheduling config mounted where BACKFILL_ROUTER_CONFIG points is the shipped file of that
    # name, or one derived from shipped files (derived_configs.py: the pd overlay's)
    mount = next(m for m in router["volumeMounts"] if m["name"] == "scheduling")
    assert str(settings.config.parent) == mount["mountPath"]
    config_map = find(objects, "ConfigMap", "backfill-router-scheduling")
    name = settings.config.name
    shipped = DERIVED[name]() if name in DERIVED else (REPO / "router" / "scheduling" / name).read_text()
    assert config_map["data"][name] == shipped
    # the processors send to the router's Service
    url = env_of(objects, "backfill-processor")["BACKFILL_PROCESSOR_ROUTER_URL"]
    assert url == f"http://backfill-router:{settings.port}"


@pytest.mark.parametrize("overlay", ["production", "pubsub"])
def test_keda_watches_the_streams_and_subscriptions_the_processors_read(rendered, overlay):
    objects = rendered[overlay]
    redis = settings_from(ProcessorSettings, "BACKFILL_PROCESSOR_", env_of(objects, "backfill-processor"))
    assert redis.backend == "redis"
    triggers = find(objects, "ScaledObject", "backfill-processor")["spec"]["triggers"]
    assert {t["metadata"]["stream"] for t in triggers} == {
        request_stream(lane, redis.pool, redis.stream_prefix) for lane in redis.lanes}
    assert {t["metadata"]["consumerGroup"] for t in triggers} == {redis.consumer_group}
    secret_keys = {"REDIS_ADDRESS", "REDIS_PASSWORD"}
    assert {t["metadata"]["addressFromEnv"] for t in triggers} | {t["metadata"]["passwordFromEnv"] for t in triggers} \
        == secret_keys
    assert secret_keys <= set(find(rendered["dev"], "Secret", "backfill-stores")["stringData"])
    if overlay == "pubsub":
        pubsub = settings_from(ProcessorSettings, "BACKFILL_PROCESSOR_", env_of(objects, "backfill-processor-pubsub"))
        assert pubsub.backend == "pubsub"
        triggers = find(objects, "ScaledObject", "backfill-processor-pubsub")["spec"]["triggers"]
        assert {t["metadata"]["subscriptionName"] for t in triggers} == {
            pubsub_request_topic(lane, pubsub.pool, pubsub.pubsub_topic_prefix) + "-processor"
            for lane in LANE_PRIORITIES}


def _aliases() -> set[str]:
    names = set()
    for settings in SETTINGS_BY_PREFIX.values():
        for field in settings.model_fields.values():
            alias = field.validation_alias
            choices = getattr(alias, "choices", None) or ([alias] if isinstance(alias, str) else [])
            names |= {c for c in choices if isinstance(c, str)}
    return names


def _source_text() -> str:
    return "\n".join(p.read_text() for d in SOURCE_DIRS for p in (REPO / d).rglob("*.py"))


def test_every_backfill_variable_is_read_by_some_service(rendered):
    """A BACKFILL_* name with a service prefix must be a field of that service's settings; any other
    must be an alias of a settings field or appear in the source (read with os.environ)."""
    aliases, source = _aliases(), _source_text()
    names = set()
    for overlay in OVERLAYS:
        for obj in rendered[overlay]:
            if obj["kind"] == "ConfigMap":
                names |= {k for k in obj["data"] if k.startswith("BACKFILL_")}
            if obj["kind"] == "Deployment":
                for container in obj["spec"]["template"]["spec"]["containers"]:
                    names |= {e["name"] for e in container.get("env", []) if e["name"].startswith("BACKFILL_")}
    assert len(names) > 20
    for name in sorted(names):
        prefix = next((p for p in SETTINGS_BY_PREFIX if name.startswith(p)), None)
        if prefix:
            field = name.removeprefix(prefix).lower()
            assert field in SETTINGS_BY_PREFIX[prefix].model_fields or name in aliases, name
        else:
            assert name in aliases or f'"{name}"' in source or f"'{name}'" in source, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_settings_validate_with_the_rendered_environment(rendered, overlay, monkeypatch):
    """Each service's settings class accepts the environment its pods get (values parse)."""
    objects = rendered[overlay]
    for deployment, settings in [("backfill-gateway", GatewaySettings), ("backfill-worker", WorkerSettings),
                                 ("backfill-beat", WorkerSettings), ("backfill-processor", ProcessorSettings),
                                 ("backfill-router", RouterSettings)]:
        built = settings_under_env(settings, {**STORE_FALLBACK, **env_of(objects, deployment)}, monkeypatch)
        if settings is GatewaySettings:
            assert built.file_store == "s3" and built.s3_bucket
        if settings is ProcessorSettings:
            assert built.saturation_gate is True
        if settings is RouterSettings:
            assert built.host == "0.0.0.0" and built.engine_priority is True


def image_version(image: str) -> tuple[int, ...]:
    """``(0, 15, 0)`` of ``vllm/vllm-openai:v0.15.0``."""
    return tuple(int(part) for part in image.rsplit(":", 1)[1].removeprefix("v").split("."))


PLUGIN_DOCKERFILE = DEPLOY / "vllm-plugin" / "Dockerfile"


def dockerfile_base(path: Path) -> str:
    """The image of the Dockerfile's (single) ``FROM`` line."""
    froms = [line.split()[1] for line in path.read_text().splitlines() if line.upper().startswith("FROM ")]
    assert len(froms) == 1, froms
    return froms[0]


def test_vllm_image_reads_the_offload_keys_the_builder_emits():
    """The vLLM release the engines' image is built on reads every CPU-tier key
    engine_twin/launch.py puts in --kv-transfer-config (v0.11.0 required num_cpu_blocks and
    refused to start)."""
    argv = vllm_engine_argv("m", 8000, ["m"], None, cpu_offload_bytes=CPU_OFFLOAD_BYTES)
    keys = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    image = dockerfile_base(PLUGIN_DOCKERFILE)
    assert image.startswith("vllm/vllm-openai:")
    assert set(keys) <= set(OFFLOAD_KEYS_SINCE), "a new key: find the first vLLM release that reads it"
    assert all(image_version(image) >= OFFLOAD_KEYS_SINCE[key] for key in keys), image
    assert not all(image_version("vllm/vllm-openai:v0.11.0") >= OFFLOAD_KEYS_SINCE[key] for key in keys)


def test_the_engines_image_is_the_plugin_tested_vllm_with_the_plugin_installed():
    """deploy/vllm-plugin/Dockerfile: FROM the vLLM release the plugin is tested on
    (engine_twin/launch.py VLLM_IMAGE, 0.32 here), the repository's vllm_plugin/ copied in and
    pip-installed into vLLM's environment without touching vLLM's own dependencies."""
    assert dockerfile_base(PLUGIN_DOCKERFILE) == VLLM_IMAGE == "vllm/vllm-openai:v0.32.0"
    text = "\n".join(line for line in PLUGIN_DOCKERFILE.read_text().splitlines() if not line.startswith("#"))
    steps = [" ".join(step.split()) for step in text.replace("\\\n", " ").splitlines() if step.strip()]
    assert "COPY vllm_plugin /plugin" in steps
    install = next(step for step in steps if step.startswith("RUN "))
    assert "pip install" in install and "/plugin" in install and "--no-deps" in install
    assert "backfill-vllm" in install  # the build fails when the distribution did not install


@pytest.mark.parametrize(("overlay", "deployments"), [("production", ["backfill-vllm"]),
                                                      ("pubsub", ["backfill-vllm"]),
                                                      ("pd", ["backfill-vllm", "backfill-vllm-prefill"])])
def test_every_vllm_pool_runs_the_plugin(rendered, overlay, deployments):
    """Each overlay's vLLM pods run the derived image (pinned), load the plugin's scheduler with
    priority scheduling and carry its settings (engine_twin/launch.py plugin_env)."""
    for deployment in deployments:
        container = container_of(rendered[overlay], deployment)
        name, tag = container["image"].rsplit(":", 1)
        assert name.rsplit("/", 1)[-1] == "backfill-vllm" and tag, container["image"]
        args = container["args"]
        assert args[args.index("--scheduler-cls") + 1] == "backfill_vllm.scheduler.BackfillScheduler"
        assert args[args.index("--scheduling-policy") + 1] == "priority"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["BACKFILL_BACKGROUND_PRIORITY_THRESHOLD"] == "-10"
        assert env["BACKFILL_MAX_BACKGROUND_PREFILL_TOKENS"] == "512"


def s3_object_key(settings: GatewaySettings, object_id: str) -> str:
    return build_file_store(settings).object_key(storage_key(object_id))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_s3_object_keys_do_not_repeat_the_stores_namespace(rendered, overlay, monkeypatch):
    """BACKFILL_S3_PREFIX goes before the store's own files/<shard>/<id> keys: a prefix ending in
    files/ made files/files/…."""
    env = {**STORE_FALLBACK, **env_of(rendered[overlay], "backfill-gateway")}
    settings = settings_under_env(GatewaySettings, env, monkeypatch)
    key = s3_object_key(settings, "file-3fa9c0")
    parts = key.split("/")
    assert key.endswith(storage_key("file-3fa9c0")) and parts.count("files") == 1, key
    doubled = settings.model_copy(update={"s3_prefix": "files/"})
    assert s3_object_key(doubled, "file-3fa9c0").split("/").count("files") == 2


def mounted_scheduling_config(objects):
    """The scheduling config the router reads (BACKFILL_ROUTER_CONFIG's file in its ConfigMap)."""
    settings = settings_from(RouterSettings, "BACKFILL_ROUTER_", env_of(objects, "backfill-router"))
    return parse_config(find(objects, "ConfigMap", "backfill-router-scheduling")["data"][settings.config.name])


def precise_router_problem(objects) -> str | None:
    """Why the routers' KV-event view is partial or their tenant limits wrong, or None: a precise
    (KV-event) producer in the mounted scheduling config while the router binds its own socket
    (each engine's connection reaches one replica) with more than one replica, or gets no KV
    events at all; or BACKFILL_ROUTER_REPLICAS differing from the Deployment's replicas (the
    per-tenant limits are divided by it)."""
    config = mounted_scheduling_config(objects)
    settings = settings_from(RouterSettings, "BACKFILL_ROUTER_", env_of(objects, "backfill-router"))
    precise = [p.instance_name for p in config.plugins if p.type == PRECISE_PRODUCER_TYPE]
    replicas = find(objects, "Deployment", "backfill-router")["spec"].get("replicas", 1)
    if settings.replicas != replicas:
        return f"BACKFILL_ROUTER_REPLICAS={settings.replicas} with {replicas} router replicas"
    if not precise:
        return None
    if not settings.kv_events:
        return f"{precise} without KV events"
    connects = bool(settings.kv_events_connect or settings.kv_events_port)
    return f"{precise} on a bound KV-event socket with {replicas} router replicas" \
        if replicas > 1 and not connects else None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_shipped_routers_route_precisely_with_two_or_more_replicas(rendered, overlay):
    objects = rendered[overlay]
    assert precise_router_problem(objects) is None
    config = mounted_scheduling_config(objects)
    assert [p.type for p in config.plugins if p.type.endswith("prefix-cache-producer")] == [PRECISE_PRODUCER_TYPE]
    assert find(objects, "Deployment", "backfill-router")["spec"]["replicas"] >= 2


def test_the_check_finds_a_bound_socket_with_several_replicas_and_a_replica_count_mismatch(rendered):
    objects = copy.deepcopy(rendered["production"])
    data = find(objects, "ConfigMap", "backfill-config")["data"]
    del data["BACKFILL_ROUTER_KV_EVENTS_PORT"]
    data["BACKFILL_ROUTER_KV_EVENTS_BIND"] = "tcp://0.0.0.0:5557"  # the single-replica wiring
    assert "bound KV-event socket with 2 router replicas" in precise_router_problem(objects)
    find(objects, "Deployment", "backfill-router")["spec"]["replicas"] = 1
    assert "BACKFILL_ROUTER_REPLICAS=2 with 1" in precise_router_problem(objects)
    data["BACKFILL_ROUTER_REPLICAS"] = "1"
    assert precise_router_problem(objects) is None
    del data["BACKFILL_ROUTER_KV_EVENTS_BIND"]
    assert "without KV events" in precise_router_problem(objects)
