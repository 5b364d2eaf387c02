"""deploy/ runs real engines with exactly the command line engine_twin/launch.py builds."""

from __future__ import annotations

from pathlib import Path

import yaml

from engine_twin.launch import vllm_engine_argv

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "vllm" / "engine-args.yaml"


def test_deploy_engine_args_match_launch():
    spec = yaml.safe_load(DEPLOY.read_text())
    expected = vllm_engine_argv("$(MODEL)", 8000, ["$(SERVED_MODEL_NAME)"], "tcp://*:5557", host="$(POD_IP)",
                                python="python3", cpu_offload_bytes=32 << 30, kv_events_replay_endpoint="tcp://*:5558",
                                plugin=True)
    assert spec["command"] + spec["args"] == expected
    assert "--enable-prefix-caching" in expected and "--enable-prompt-tokens-details" in expected
