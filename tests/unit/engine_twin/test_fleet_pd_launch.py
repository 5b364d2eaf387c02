"""Launch lines of prefill/decode engines: ``pd_role`` → vLLM's NixlConnector ``--kv-transfer-config``
for the twin and real vLLM, the side channel's environment, and the settings the twin parses."""

import json

import pytest

from engine_twin.cli import settings_from_args
from engine_twin.launch import (
    kv_transfer_config_json,
    pd_engine_env,
    side_channel_port_for,
    sim_engine_argv,
    vllm_engine_argv,
)


def transfer_of(argv):
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize(("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer"),
                                               ("both", "kv_both")])
def test_pd_role_adds_nixl_in_vllms_role(role, kv_role):
    argv = sim_engine_argv(8001, ["m"], pd_role=role)
    assert transfer_of(argv) == {"kv_connector": "NixlConnector", "kv_role": kv_role}
    settings = settings_from_args(argv[argv.index("engine-sim") + 1:])
    assert settings.nixl and settings.kv_transfer_config is not None
    assert settings.kv_transfer_config.kv_role == kv_role
    assert transfer_of(vllm_engine_argv("/models/x", 8001, ["m"], pd_role=role))["kv_role"] == kv_role


def test_no_role_no_connector_and_an_unknown_role_is_refused():
    assert "--kv-transfer-config" not in sim_engine_argv(8001, ["m"])
    with pytest.raises(ValueError, match="pd_role"):
        sim_engine_argv(8001, ["m"], pd_role="prefiller")
    with pytest.raises(ValueError, match="pd_role"):
        kv_transfer_config_json("kv_producer")


def test_the_failure_policy_and_bandwidth_reach_the_twins_settings():
    argv = sim_engine_argv(8001, ["m"], pd_role="decode", kv_load_failure_policy="recompute",
                           kv_transfer_bandwidth_gb_s=450.0)
    settings = settings_from_args(argv[argv.index("engine-sim") + 1:])
    assert settings.kv_transfer_config is not None
    assert settings.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert settings.kv_transfer_bandwidth_gb_s == 450.0


def test_the_side_channel_environment_uses_vllms_names(monkeypatch):
    env = pd_engine_env(side_channel_port_for(8001), "10.0.0.5", base={"PATH": "/bin"})
    assert env == {"PATH": "/bin", "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.5", "VLLM_NIXL_SIDE_CHANNEL_PORT": "18001"}
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "18001")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.0.0.5")
    monkeypatch.setenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "60")
    settings = settings_from_args(["--kv-transfer-config", kv_transfer_config_json("prefill")])
    assert (settings.nixl_side_channel_host, settings.side_channel_port) == ("10.0.0.5", 18001)
    assert settings.nixl_abort_request_timeout_s == 60.0
    with pytest.raises(ValueError, match="side-channel"):
        side_channel_port_for(60000)


def test_vllm_with_the_cpu_tier_and_a_role_gets_a_multiconnector_nixl_first():
    argv = vllm_engine_argv("/models/x", 8001, ["m"], cpu_offload_bytes=1 << 30, pd_role="decode")
    transfer = transfer_of(argv)
    assert transfer["kv_connector"] == "MultiConnector" and transfer["kv_role"] == "kv_consumer"
    first, second = transfer["kv_connector_extra_config"]["connectors"]
    assert first == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    assert second["kv_connector"] == "OffloadingConnector"
