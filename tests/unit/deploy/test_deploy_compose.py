"""deploy/compose.yaml and the Dockerfile: the compose file is valid Compose Specification (the
schema vendored in check-jsonschema; `docker compose config` is not installed here), its start-up
order and healthchecks hold, its engines run the launch builder's command line, and the image
runs `backfill` as a non-root user."""

from __future__ import annotations

import copy
import importlib.resources
import json
import re

import jsonschema
import pytest
import yaml
from compose_env import MissingVariable, interpolate, service_environment
from conftest import DEPLOY, REPO, settings_from, settings_under_env

from async_processor.settings import ProcessorSettings
from engine_twin.launch import sim_engine_argv
from router.settings import build_settings

COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
#: what `docker compose` is run with
SHELL = {"BACKFILL_ADMIN_KEY": "compose-test-admin-key", "BACKFILL_ROUTER_TOKEN": "compose-test-router-token"}
SERVICES = COMPOSE["services"]
BACKFILL_SERVICES = {"migrate", "gateway", "worker", "beat", "processor", "router", "engine-0", "engine-1"}


def compose_schema() -> dict:
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads(vendor.joinpath("compose-spec.json").read_text())


def compose_errors(document: dict) -> list[str]:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{e.json_path}: {e.message}" for e in validator.iter_errors(document)]


def test_compose_file_is_valid_compose_specification():
    assert compose_errors(COMPOSE) == []


def test_schema_check_rejects_a_bad_compose_file():
    broken = copy.deepcopy(COMPOSE)
    broken["services"]["gateway"]["depends_on"]["migrate"]["condition"] = "service_done"
    broken["services"]["router"]["healthchek"] = broken["services"]["router"].pop("healthcheck")
    errors = compose_errors(broken)
    assert any("depends_on" in e for e in errors) and any("healthchek" in e for e in errors)


def test_compose_runs_every_service():
    assert BACKFILL_SERVICES | {"postgres", "redis"} == set(SERVICES)
    commands = {name: SERVICES[name]["command"][0] for name in BACKFILL_SERVICES}
    assert commands == {"migrate": "migrate", "gateway": "gateway", "worker": "worker", "beat": "beat",
                        "processor": "processor", "router": "router", "engine-0": "engine-sim",
                        "engine-1": "engine-sim"}
    for name in BACKFILL_SERVICES:
        service = SERVICES[name]
        assert service["image"] == "backfill:dev" and service["build"]["context"] == ".."
        assert service["user"] == "10001:10001" and service["read_only"] is True
        assert "/tmp" in service["tmpfs"]


def test_start_up_order_and_healthchecks():
    for name, service in SERVICES.items():
        if name != "migrate":
            assert service["healthcheck"]["test"], name
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in SERVICES, (name, dependency)
            expected = "service_completed_successfully" if dependency == "migrate" else "service_healthy"
            assert condition["condition"] == expected, (name, dependency)
            assert dependency == "migrate" or "healthcheck" in SERVICES[dependency]
    assert SERVICES["migrate"]["restart"] == "no"
    assert SERVICES["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for name in ("gateway", "worker", "beat"):
        assert SERVICES[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert set(SERVICES["router"]["depends_on"]) == {"engine-0", "engine-1"}
    assert set(SERVICES["processor"]["depends_on"]) == {"redis", "router"}


def _health_port(service: dict) -> int | None:
    match = re.search(r"https?://[^:/]+:(\d+)/health", " ".join(service["healthcheck"]["test"]))
    return int(match[1]) if match else None


@pytest.mark.parametrize("index", [0, 1])
def test_engines_run_the_launch_builders_command(index):
    name = f"engine-{index}"
    service = SERVICES[name]
    expected = sim_engine_argv(8000, ["sim-model"], "tcp://router:5557", host=name)
    assert service["command"] == expected[1:]
    assert _health_port(service) == 8000


def test_router_and_processor_settings_from_compose(monkeypatch):
    """The router's settings as `backfill router` builds them (build_settings() from the environment,
    where BACKFILL_ROUTER_ENGINES is a separated string, not a JSON list)."""
    router_env = service_environment(COMPOSE, "router", SHELL)
    router = settings_under_env(build_settings, router_env, monkeypatch)
    assert router.engines == [f"http://engine-{i}:8000" for i in range(2)]
    assert router.kv_events_bind.endswith(":5557") and _health_port(SERVICES["router"]) == router.port
    mount = SERVICES["router"]["volumes"][0].split(":")
    assert (DEPLOY / mount[0]).resolve() == REPO / "router" / "scheduling" / "default-config.yaml"
    assert mount[1] == str(router.config)
    processor_env = SERVICES["processor"]["environment"]
    processor = settings_from(ProcessorSettings, "BACKFILL_PROCESSOR_", processor_env)
    assert processor.router_url == f"http://router:{router.port}" and processor.saturation_gate
    assert _health_port(SERVICES["processor"]) == int(processor_env["BACKFILL_METRICS_PORT"])
    assert _health_port(SERVICES["worker"]) == int(SERVICES["worker"]["environment"]["BACKFILL_METRICS_PORT"])


def test_dockerfile_builds_a_non_root_backfill_image():
    lines = [line.strip() for line in (REPO / "Dockerfile").read_text().splitlines()
             if line.strip() and not line.strip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    user = next(line for line in lines if line.startswith("USER "))
    assert user.split()[1].split(":")[0] not in {"0", "root"}
    assert json.loads(next(line for line in lines if line.startswith("ENTRYPOINT "))[len("ENTRYPOINT "):]) == ["backfill"]
    install = next(line for line in lines if line.startswith("RUN pip install "))
    assert install.split()[3] == "."
    copied = {line.split()[1] for line in lines if line.startswith("COPY ")}
    packages = set(re.findall(r'"(\w+)\*"', (REPO / "pyproject.toml").read_text().split("packages.find", 1)[1]
                              .split("\n\n", 1)[0]))
    assert packages and packages <= copied  # every package of the distribution is in the build
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".git" in ignored and ".venv" in ignored
    assert not copied & set(ignored)


def test_interpolation_follows_compose():
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("$$SET ${SET} $SET ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} ${SET:?x}", env) == "$SET v v d d  v"
    with pytest.raises(MissingVariable):
        interpolate("${EMPTY:?needed}", env)


def test_admin_key_comes_from_the_environment_only():
    """No well-known default key: every service that reads BACKFILL_ADMIN_KEY refuses to start
    without it (Compose stops at interpolation) and otherwise gets exactly the caller's."""
    readers = [name for name, service in SERVICES.items() if "BACKFILL_ADMIN_KEY" in (service.get("environment") or {})]
    assert "gateway" in readers
    for name in readers:
        with pytest.raises(MissingVariable):
            service_environment(COMPOSE, name, {})
        with pytest.raises(MissingVariable):
            service_environment(COMPOSE, name, {"BACKFILL_ADMIN_KEY": ""})
        assert service_environment(COMPOSE, name, SHELL)["BACKFILL_ADMIN_KEY"] == SHELL["BACKFILL_ADMIN_KEY"]


def test_published_ports_listen_on_loopback_only():
    published = {name: service["ports"] for name, service in SERVICES.items() if service.get("ports")}
    assert set(published) == {"gateway", "router"}
    for name, ports in published.items():
        for port in ports:
            host_ip = port.get("host_ip") if isinstance(port, dict) else str(port).rsplit(":", 2)[0]
            assert host_ip == "127.0.0.1", (name, port)
