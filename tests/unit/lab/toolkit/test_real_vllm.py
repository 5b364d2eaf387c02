"""lab.toolkit.real_vllm without vLLM: model shapes, argv and environment, the tokenizer and plugin layout."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lab.toolkit import real_vllm as rv


def test_bench_model_is_in_the_issue_range_and_its_kv_cache_holds_whole_contexts():
    spec = rv.BENCH
    assert 512 <= spec.hidden_size <= 1024 and 4 <= spec.num_hidden_layers <= 8
    assert 2048 <= spec.max_position_embeddings <= 4096
    assert spec.head_dim == 64
    assert spec.kv_bytes_per_token() == 2 * 4 * 4 * 64 * 4
    # 1 GiB of VLLM_CPU_KVCACHE_SPACE holds many full contexts of the bench sizes (16 sequences)
    assert spec.kv_cache_tokens() == 2**30 // 8192
    assert spec.kv_cache_tokens() >= 16 * spec.max_position_embeddings
    assert spec.key == "llama-h512-i1408-l4-a8-kv4-ctx4096-tied"
    tied, untied = spec.params(1000), rv.ModelSpec(**{**spec.__dict__, "tie_word_embeddings": False}).params(1000)
    assert untied - tied == 1000 * 512


def test_engine_argv_with_and_without_the_plugin():
    sizes = rv.EngineSizes(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=4096, num_gpu_blocks=384)
    plain = rv.engine_argv(Path("/v/bin/python"), Path("/m"), 8123, ["tiny"], sizes, plugin=False)
    with_plugin = rv.engine_argv(Path("/v/bin/python"), Path("/m"), 8123, ["tiny"], sizes, plugin=True)
    assert plain[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in {"--model": "/m", "--port": "8123", "--scheduling-policy": "priority", "--dtype": "float32",
                        "--max-num-seqs": "8", "--max-num-batched-tokens": "1024", "--max-model-len": "4096",
                        "--num-gpu-blocks-override": "384", "--block-size": "32"}.items():
        assert plain[plain.index(flag) + 1] == value, flag
    assert "--enforce-eager" in plain and "--enable-prefix-caching" in plain
    assert "--scheduler-cls" not in plain
    assert with_plugin[with_plugin.index("--scheduler-cls") + 1] == "backfill_vllm.scheduler.BackfillScheduler"
    assert [a for a in with_plugin if a not in ("--scheduler-cls", rv.PLUGIN_SCHEDULER_CLS)] == plain


def test_engine_env_puts_the_plugin_first_on_the_path_only_for_the_plugin_variant():
    base = {"PATH": "/bin", "PYTHONPATH": "/x"}
    plain = rv.engine_env(rv.BENCH, base=base)
    assert plain["PYTHONPATH"] == "/x" and "BACKFILL_BACKGROUND_PRIORITY_THRESHOLD" not in plain
    assert plain["VLLM_CPU_KVCACHE_SPACE"] == "1" and plain["PYTHONHASHSEED"] == "0"
    env = rv.engine_env(rv.BENCH, plugin_path=Path("/site"), max_background_prefill_tokens=256, base=base)
    assert env["PYTHONPATH"].split(":") == ["/site", "/x"]
    assert env["BACKFILL_BACKGROUND_PRIORITY_THRESHOLD"] == "-10"
    assert env["BACKFILL_MAX_BACKGROUND_PREFILL_TOKENS"] == "256"


def test_twin_argv_has_the_same_sizes_the_fleet_protections_and_the_step_flags():
    sizes = rv.EngineSizes(max_num_seqs=8, max_num_batched_tokens=1024)
    argv = rv.twin_argv(9000, ["tiny"], rv.BENCH, sizes, ["--peak-tflops", "0.5"])
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == str(rv.BENCH.kv_cache_tokens() // 32)
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "1024"
    assert argv[argv.index("--background-priority-threshold") + 1] == "-10"
    assert argv[argv.index("--scheduling-policy") + 1] == "priority"
    assert argv[-2:] == ["--peak-tflops", "0.5"]


def test_vllm_venv_names_the_virtualenv_and_a_missing_one_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_VENV", str(tmp_path / "none"))
    assert rv.venv_dir(tmp_path) == tmp_path / "none"
    with pytest.raises(FileNotFoundError, match="VLLM_VENV"):
        rv.venv_python(tmp_path)
    monkeypatch.delenv("VLLM_VENV")
    assert rv.venv_dir(tmp_path) == tmp_path / "venv"


def test_tokenizer_comes_out_of_the_litellm_wheel_once(tmp_path):
    (tmp_path / "dl").mkdir()
    with zipfile.ZipFile(tmp_path / "dl" / "litellm-9.9.9-py3-none-any.whl", "w") as wheel:
        wheel.writestr(rv.TOKENIZER_MEMBER, '{"model": "x"}')
    out = rv.tokenizer_file(tmp_path, Path("/no/python"))  # the wheel is there: pip is not run
    assert out.read_text() == '{"model": "x"}'
    assert rv.tokenizer_file(tmp_path, Path("/no/python")) == out


def test_a_built_model_is_reused_without_building(tmp_path):
    out = tmp_path / "models" / rv.TINY.key
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / "tokenizer.json").write_text("{}")
    assert rv.model_dir(tmp_path, rv.TINY, Path("/no/python")) == out


def test_the_plugin_site_carries_the_entry_points_without_touching_any_virtualenv(tmp_path):
    source = tmp_path / "plugin"
    (source / "demo_plugin").mkdir(parents=True)
    (source / "demo_plugin" / "__init__.py").write_text("def register():\n    return 'registered'\n")
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "demo-plugin"\nversion = "0.1"\n'
        '[project.entry-points."vllm.general_plugins"]\ndemo = "demo_plugin:register"\n'
        '[tool.setuptools]\npackages = ["demo_plugin"]\n')
    site = rv.plugin_site(tmp_path / "work", Path(sys.executable), source)
    assert rv.plugin_site(tmp_path / "work", Path(sys.executable), source) == site  # same content: reused
    found = subprocess.run([sys.executable, "-c", (
        "import importlib.metadata as m\n"
        "[ep] = [e for e in m.entry_points(group='vllm.general_plugins') if e.name == 'demo']\n"
        "print(ep.load()())")], env={"PYTHONPATH": str(site)}, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "registered"
    (source / "demo_plugin" / "__init__.py").write_text("def register():\n    return 'edited'\n")
    assert rv.plugin_site(tmp_path / "work", Path(sys.executable), source) != site  # an edit reinstalls


def test_no_plugin_in_the_checkout_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no vLLM plugin"):
        rv.plugin_site(tmp_path, Path(sys.executable), tmp_path / "vllm_plugin")


def test_an_unknown_variant_is_refused(tmp_path):
    from lab.toolkit.launch import process_group

    with process_group(tmp_path) as group, pytest.raises(ValueError, match="unknown engine variant"):
        with rv.serving("sglang", group):
            pass
