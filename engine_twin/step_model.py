"""How long one engine step takes, in model seconds: a roofline-style sum, no fit.

One step of vLLM V1 runs every scheduled token of every scheduled request through the model once
(decode tokens and prefill chunks alike). Its duration here is the sum of four terms::

    step = fixed                                        weights read once + launch overhead
         + Σ tokens × 2·P / (peak × MFU)                linear layers, all scheduled tokens
         + Σ pairs × 4·L·H·D / (peak × MFU)             attention scores and values (causal)
         + Σ context × KV bytes per token / (HBM × MBU)  every scheduled request reads its past KV
         + loads and stores × block bytes / (PCIe | NVMe)  CPU / disk tier traffic

    fixed = P × bytes per parameter / (HBM × MBU) + step_overhead

where ``P`` is the parameter count, ``L`` the layers, ``H × D`` the attention width (query heads ×
head size), ``pairs`` the (query, key) pairs of the step (a chunk of ``n`` tokens after ``c``
computed ones has ``n·c + n(n+1)/2``), ``context`` the tokens a request had computed before the
step, and KV bytes per token = 2 (K and V) × L × KV heads × D × bytes per value. The terms are added,
not overlapped, so the model errs slow when compute and memory traffic would overlap on a GPU.

Default constants: Llama-3.1-8B in bf16 on one NVIDIA H100 SXM (published figures, not a fit; no
GPU was available when this was written):

* ``P = 8.03e9``, 32 layers, 32 query heads, 8 KV heads, head size 128 (Meta's Llama-3.1-8B model
  card and ``config.json``); bf16: 2 bytes per parameter and per KV value, so the KV cache holds
  2 × 32 × 8 × 128 × 2 = 131,072 bytes (128 KiB) per token, 2 MiB per 16-token block.
* HBM3 bandwidth 3.35 TB/s and 989 TFLOPS dense bf16 (NVIDIA H100 SXM datasheet).
* ``MBU = 0.77``: batch-1 decode of Llama-3.1-8B under vLLM 0.23 measured at about 77 % of the
  memory-bandwidth ceiling (J. Musgrave, "vLLM throughput-latency sweep on NVIDIA A100", 2025:
  ~75 tokens/s on an A100 40GB).
* ``MFU = 0.5``: llm-d's calibration of about 16,000 prefill tokens/s for a 32B model on two H100s
  (already the twin's prefill rate before this model) is 16,000 × 2 × 32e9 / (2 × 989e12) ≈ 52 %
  of peak.
* ``step_overhead = 2 ms``: per-step CPU work (scheduling, input preparation, sampling, detokenizing)
  that vLLM's v0.6.0 performance post (blog.vllm.ai, 2024-09-05) found to be a large share of an
  8B model's step on one H100 before it was overlapped; an estimate, not a measured figure.
* CPU tier 25 GB/s (PCIe host-device copies, Gen4 x16 effective; Gen5 doubles it) and disk tier
  5 GB/s (a local NVMe SSD): the twin's block load times before this model, 0.08 and 0.4 ms per 2 MiB.
* Prefill/decode KV transfer (NixlConnector) 50 GB/s: one 400 Gb/s RDMA NIC per GPU (ConnectX-7 NDR
  in the NVIDIA DGX H100 datasheet), so a 2 MiB block takes 42 µs and a 4,096-token prompt 10.7 ms
  (``--kv-transfer-bandwidth``; NVLink 4 within a node is 450 GB/s per direction).

Sanity checks against published measurements: an idle engine's decode step is 16.06 GB /
(3.35 TB/s × 0.77) + 2 ms ≈ 8.2 ms (llm-d's inference simulator profile for an 8B model on H100:
12 ms inter-token latency; the A100 measurement above: 13 ms on a GPU with half the bandwidth). A
prefill runs at 2 × 8.03e9 / (989e12 × 0.5) ≈ 32 µs per token before attention, about 30,000
tokens/s for short prompts, about 21,600 tokens/s over a whole 24k-token prompt as attention grows.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_twin.settings import EngineSimSettings


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one step computes and moves. Counts are tokens, (query, key) pairs and blocks."""

    tokens: int = 0
    attention_pairs: int = 0
    context_tokens: int = 0
    cpu_loads: int = 0
    disk_loads: int = 0
    cpu_stores: int = 0
    disk_stores: int = 0


@dataclass(frozen=True, slots=True)
class StepModel:
    """Seconds per unit of :class:`StepWork` (see the module docstring for the formula)."""

    fixed_s: float
    token_s: float
    pair_s: float
    context_token_s: float
    cpu_block_s: float
    disk_block_s: float
    kv_bytes_per_token: float
    kv_transfer_block_s: float = 0.0
    """Seconds to move one block's KV between engines (NixlConnector), over ``--kv-transfer-bandwidth``."""

    @classmethod
    def from_settings(cls, s: EngineSimSettings) -> StepModel:
        flops = s.peak_tflops * 1e12 * s.mfu
        hbm = s.hbm_bandwidth_gb_s * 1e9 * s.mbu
        kv_bytes = 2 * s.num_hidden_layers * s.num_key_value_heads * s.head_dim * s.model_dtype_bytes
        block_bytes = kv_bytes * s.block_size
        return cls(
            fixed_s=s.model_params * s.model_dtype_bytes / hbm + s.step_overhead_ms / 1000,
            token_s=2 * s.model_params / flops,
            pair_s=4 * s.num_hidden_layers * s.num_attention_heads * s.head_dim / flops,
            context_token_s=kv_bytes / hbm,
            cpu_block_s=block_bytes / (s.pcie_gb_s * 1e9),
            disk_block_s=block_bytes / (s.nvme_gb_s * 1e9),
            kv_bytes_per_token=kv_bytes,
            kv_transfer_block_s=block_bytes / (s.kv_transfer_bandwidth_gb_s * 1e9),
        )

    def seconds(self, w: StepWork) -> float:
        """Duration of a step doing ``w``; 0 when it schedules nothing."""
        if not w.tokens:
            return 0.0
        return (self.fixed_s + w.tokens * self.token_s + w.attention_pairs * self.pair_s
                + w.context_tokens * self.context_token_s
                + (w.cpu_loads + w.cpu_stores) * self.cpu_block_s + (w.disk_loads + w.disk_stores) * self.disk_block_s)

    def kv_transfer_seconds(self, blocks: int) -> float:
        """Model seconds to read ``blocks`` KV blocks from a remote engine: blocks × block size × KV
        bytes per token ÷ the link's bandwidth (NIXL reads whole blocks)."""
        return blocks * self.kv_transfer_block_s

    def prefill_seconds(self, tokens: int) -> float:
        """One step computing a fresh prompt of ``tokens`` alone (used for ``/v1/embeddings``)."""
        return self.seconds(StepWork(tokens, tokens * (tokens + 1) // 2))


def chunk_pairs(computed: int, new: int) -> int:
    """(query, key) pairs of ``new`` tokens scheduled after ``computed`` ones, causal attention."""
    return new * computed + new * (new + 1) // 2


def overhead_ms_for_idle_step(itl_ms: float, settings: EngineSimSettings | None = None) -> float:
    """The ``step_overhead_ms`` that makes an idle engine's decode step (one request, short context)
    last ``itl_ms``; 0 when the weights read alone takes longer. For launch lines that used to name
    an inter-token latency (``--itl-ms``)."""
    from engine_twin.settings import build_settings

    s = settings or build_settings()
    bare = StepModel.from_settings(s.model_copy(update={"step_overhead_ms": 0.0}))
    return max(0.0, itl_ms - 1000 * bare.seconds(StepWork(1, 1, 0)))
