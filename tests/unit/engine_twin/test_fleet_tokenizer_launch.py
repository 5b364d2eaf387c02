"""Tokenizers, chat template, settings and the engines' command lines."""

import json

import pytest
from pydantic import ValidationError

from common.chatml import render_chat
from engine_twin.cli import settings_from_args
from engine_twin.engine import SimEngine
from engine_twin.kv_cache import DEFAULT_RETENTION
from engine_twin.launch import sim_engine_argv, vllm_engine_argv, vllm_engine_env
from engine_twin.protocol import GenerationSpec
from engine_twin.settings import build_settings
from engine_twin.tokenizer import BuiltinTokenizer, HFTokenizer
from router.flow_control.config import FlowControlConfig
from router.parsing import engine_priority


def test_builtin_tokenizer_round_trips_and_keeps_prefixes():
    tok = BuiltinTokenizer()
    text = "héllo wörld, a shared prefix"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode(text + " and more")[: len(text.encode()) // 4] == ids[: len(text.encode()) // 4]
    filler, fids = tok.filler(20)
    assert len(fids) == 20 and tok.decode(fids) == filler


def test_hf_tokenizer_from_a_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "the": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    hf = HFTokenizer(str(path))
    assert hf.encode("hello world") == [1, 2]
    text, ids = hf.filler(3)
    assert len(ids) == 3


def test_chat_template_renders_roles_and_text_parts():
    text = render_chat([{"role": "system", "content": "s"},
                        {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert text == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_settings_refuse_a_gpu_pool_smaller_than_one_request():
    with pytest.raises(ValidationError):
        build_settings(num_gpu_blocks=10, max_model_len=1024, block_size=16)


def test_cli_takes_vllm_flag_formats():
    s = settings_from_args(["--served-model-name", "a", "b", "--num-gpu-blocks-override", "2048",
                            "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq", '
                            '"endpoint": "tcp://*:5557", "topic": "t"}', "--scheduling-policy", "priority",
                            "--enable-prompt-tokens-details", "--block-size", "16"])
    assert s.served_model_name == ["a", "b"] and s.num_gpu_blocks == 2048
    assert s.kv_events_config.active and s.kv_events_config.topic == "t"
    assert s.enable_prompt_tokens_details and s.scheduling_policy == "priority"


def test_sim_argv_round_trips_through_the_cli_parser():
    argv = sim_engine_argv(8123, ["gpt-3.5-turbo", "meta-llama/Meta-Llama-3-8B-Instruct"], "tcp://127.0.0.1:5557",
                           num_gpu_blocks=4096, cpu_offload_blocks=512, time_scale=0.0)
    s = settings_from_args(argv[argv.index("engine-sim") + 1:])
    assert s.port == 8123 and s.served_model_name[1] == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert s.kv_events_config.topic == "kv@127.0.0.1:8123@gpt-3.5-turbo"
    assert s.cpu_offload_blocks == 512 and s.time_scale == 0.0 and s.hash_seed == "0"


def test_fleet_engines_keep_batch_blocks_at_the_lowest_retention_and_others_at_the_default():
    """The cache-pollution guard's wiring: the fleet's argv sets --retention-priority-threshold so the
    router's vLLM priority for the batch band (router/parsing.py) gives retention 0 and the other
    bands keep the default; None leaves the simulator's default (off: everyone at the default)."""
    bands = {b.objective: engine_priority(b.priority) for b in FlowControlConfig().bands}
    def engine(argv):
        return SimEngine(settings_from_args(argv[argv.index("engine-sim") + 1:]))

    fleet = engine(sim_engine_argv(8123, ["m"]))
    assert {objective: fleet.retention_of(GenerationSpec("chat", "m", [[1]], 4, "length", priority=p))
            for objective, p in bands.items()} == {"interactive": DEFAULT_RETENTION, "async": DEFAULT_RETENTION,
                                                   "flex": DEFAULT_RETENTION, "batch": 0}
    plain = engine(sim_engine_argv(8123, ["m"], retention_priority_threshold=None))
    assert plain.settings.retention_priority_threshold is None
    assert plain.retention_of(GenerationSpec("chat", "m", [[1]], 4, "length", priority=bands["batch"])) == \
        DEFAULT_RETENTION


def test_vllm_argv_has_the_fleet_settings():
    argv = vllm_engine_argv("/models/x", 8001, ["m"], "tcp://10.0.0.2:5557", host="10.0.0.1",
                            cpu_offload_bytes=8 << 30, block_size=16)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details"):
        assert flag in argv
    assert argv[argv.index("--scheduling-policy") + 1] == "priority"
    assert argv[argv.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://10.0.0.2:5557",
                      "topic": "kv@10.0.0.1:8001@m"}
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "OffloadingConnector"
    assert transfer["kv_connector_extra_config"]["cpu_bytes_to_use"] == 8 << 30
    assert vllm_engine_env("7", base={})["PYTHONHASHSEED"] == "7"
