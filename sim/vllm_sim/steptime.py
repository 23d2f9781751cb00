"""How long one engine step takes: a roofline per GPU plus fixed host costs.

The step is memory-bound while it streams weights and KV (decode) and compute-bound once the
token budget is spent on prefill; which one wins is exactly the trade-off the token budget knob
moves, so the model must keep both terms and never beat either physical floor.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from vllm_sim.catalog import BF16, GpuSpec, ModelSpec

FloatArray = npt.NDArray[np.float64]


def _physics_digest() -> str:
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in ("steptime.py", "catalog.py", "kv.py", "scheduler.py", "engine.py"):
        try:
            h.update((here / name).read_bytes())
        except OSError:  # installed without sources: the name stands in
            h.update(name.encode())
    return h.hexdigest()[:16]


REF_CLOCK_GHZ = 1.98  # H100 SXM boost: c_layer_s is a time at this clock
REF_SM_COUNT = 132
REF_BW_PER_SM = 3.05e12 / REF_SM_COUNT  # H100 SXM: achievable bytes/s per SM (its KV-tail unit)


@dataclass(frozen=True)
class Calibration:
    """Every fitted efficiency and overhead constant of the step-time model, in one place.

    Shared by every model, GPU and TP degree; a GPU brings only its own physics
    (vllm_sim.catalog.GpuSpec: achievable bandwidth of its memory, tensor-core peaks, SMs and
    clock). Fitted on the H100 runs only (calibration-h100.yaml and calibration-h100-llama3.yaml;
    `python -m bench.fidelity.fit`), checked on runs never fitted on (check.yaml: other
    workloads and knobs of Llama-3.1-8B on H100, and every A100 and L40S run). docs/fidelity.md
    has the split, the numbers and the reasons for each term.
    """

    # Weights and KV stream at these fractions of the GPU's *achievable* bandwidth.
    eta_bw_weights: float = 1.0
    eta_bw_kv: float = 1.0
    # Decode attention runs one work unit per (sequence, KV head of this rank) and layer, without
    # splitting the context once there are enough units to fill the GPU (FlashAttention's
    # split-KV heuristic). A few long units per SM leave the tail of every attention kernel to a
    # handful of SMs, which costs about this many units' worth of streaming per SM: KV reads run
    # at eta_bw_kv * u / (u + kv_tail_units_per_sm * SMs), u = seqs x KV heads per rank (at
    # least the tail itself, where the split heuristic takes over, so never below half).
    # The value is for an SM with an H100's share of the bandwidth; a GPU whose SMs each have a
    # smaller share (GDDR6 L40S: 0.22 of it) fills it with proportionally fewer units.
    kv_tail_units_per_sm: float = 1.025
    # GEMMs and attention at this fraction of the tensor-core peak of their type.
    eta_mfu: float = 0.75
    # A GEMM streams its weights and multiplies them in a pipeline; this fraction of the shorter
    # of the two does not hide behind the longer (0: a perfect roofline, 1: no overlap), scaled
    # by the memory's share of the step. On GPUs with asynchronous MMAs fed by TMA
    # (GpuSpec.async_mma: Hopper, Blackwell) it is fitted; Ampere and Ada wait on their
    # synchronous MMAs, so there it is 1: a memory-bound step (decode) exposes its math in full,
    # which makes its cost per extra sequence follow those GPUs' compute rather than their
    # bandwidth, while a compute-bound one (a long prefill chunk) hides its weight loads in the
    # multistage copy pipeline, as the GEMM microbenchmarks behind eta_mfu measure them.
    gemm_overlap_loss: float = 0.0
    # GPU time of the small kernels of one layer (norms, RoPE, activation, cache writes, graph
    # launch) that do not depend on the batch, at REF_CLOCK_GHZ; scales with 1/clock.
    c_layer_s: float = 21e-6
    # Host: scheduling, input preparation, sampling bookkeeping per step and per sequence.
    c_host_s: float = 0.47e-3
    c_seq_s: float = 3.6e-6
    # Sampling with the model's default top-p/top-k (vLLM applies the checkpoint's
    # generation_config, and instruct models ship one) sorts every sequence's logits over the
    # whole vocabulary (radix-sort passes over fp32 keys and int64 indices, softmax, cumulative
    # sum). A sequence's logits (vocab x 4 B, ~0.5 MB) stay in L2, so the passes run at the
    # SMs' rate, not DRAM's: seconds per sequence and vocabulary entry on an H100 (132 SMs at
    # REF_CLOCK_GHZ), scaled by the GPU's SMs x clock.
    sampler_s_per_vocab: float = 0.24e-9
    allreduce_latency_s: float = 13.7e-6  # per all-reduce (two per layer) when TP > 1
    eta_link: float = 0.37  # achieved / peak interconnect bandwidth in MB-sized all-reduces
    # API server to engine core (tokenization, IPC) before a request can be scheduled: part of
    # TTFT, not of queue time. The measured TTFT is client-side, so it also holds HTTP and
    # streaming; only the sum with the client overhead is identified.
    c_frontend_s: float = 4e-3
    # Fused-MoE expert GEMMs may run below the dense MFU; their FLOPs are divided by this.
    eta_moe: float = 1.0
    # A digest of the simulator's physics sources (step time, GPU and model catalog, KV sizing,
    # scheduler, engine): part of the constants, so that anything keyed on them (bench/tuning's
    # oracle cache) also sees a change of the formulas or of a GPU's numbers.
    physics: str = field(default_factory=lambda: _physics_digest(), repr=False)


CALIBRATION = Calibration()


class StepTimeModel:
    """Step durations for one model on one GPU type at one TP degree.

    A step streams the weights it needs and the KV it reads (memory time), multiplies its tokens
    through the GEMMs and attention (compute time), overlapping the two as far as a pipelined
    kernel can (`gemm_overlap_loss`), and pays a per-layer floor of small kernels (GPU clock), the
    host's scheduling (per step and per sequence) and, with TP, two all-reduces per layer.
    """

    def __init__(
        self,
        model: ModelSpec,
        gpu: GpuSpec,
        tp: int,
        kv_bytes_per_token: int,
        calibration: Calibration = CALIBRATION,
        bandwidth_efficiency: float = 1.0,
        compute_efficiency: float = 1.0,
    ) -> None:
        self.model = model
        self.gpu = gpu
        self.tp = tp
        cal = calibration
        # Efficiencies can be moved by Reality, but never above the hardware's peak.
        bw = gpu.achievable_bandwidth
        w_bw = min(gpu.hbm_bandwidth, cal.eta_bw_weights * bandwidth_efficiency * bw)
        kv_bw = min(gpu.hbm_bandwidth, cal.eta_bw_kv * bandwidth_efficiency * bw)
        eta = min(1.0, cal.eta_mfu * compute_efficiency)
        self._w_bw = w_bw
        self._kv_per_token_s = kv_bytes_per_token / kv_bw
        self._kv_heads = model.kv_heads_per_rank(tp)
        # Little's law: an SM needs bandwidth x latency bytes in flight to keep its share of the
        # memory busy, and one attention unit keeps a bounded number in flight; so the tail, in
        # units per SM, grows with the SM's share of the bandwidth (GDDR6 L40S: 0.22 of an
        # H100 SM's share, A100-80GB 0.72).
        share = gpu.achievable_bandwidth / gpu.sm_count / REF_BW_PER_SM
        self._kv_tail_units = cal.kv_tail_units_per_sm * gpu.sm_count * share
        # GEMM FLOPs per token on the tensor cores of the quantization's type; experts apart.
        kind = model.quant.compute if model.quant.quantized else BF16
        gemm_rate = eta * gpu.peak_flops(kind)
        bf16_rate = eta * gpu.bf16_flops
        routed = model.moe_layers * model.num_experts_per_tok * model.expert_params
        dense_part = model.active_params_per_token - routed
        moe_part = routed / cal.eta_moe
        self._s_per_token = 2.0 * (dense_part + moe_part) / tp / gemm_rate
        self._s_per_logit = 2.0 * model.hidden_size * model.vocab_size / tp / bf16_rate
        self._s_per_pair = (
            4.0 * model.num_hidden_layers * model.num_attention_heads * model.head_dim / tp
        ) / bf16_rate
        self._loss = cal.gemm_overlap_loss if gpu.async_mma else 1.0
        self._fixed = (
            cal.c_host_s
            + cal.c_layer_s * model.num_hidden_layers * REF_CLOCK_GHZ / gpu.boost_clock_ghz
        )
        on_chip = gpu.sm_count * gpu.boost_clock_ghz / (REF_SM_COUNT * REF_CLOCK_GHZ)
        self._c_seq = cal.c_seq_s + cal.sampler_s_per_vocab * model.vocab_size / on_chip
        n_ar = 2 * model.num_hidden_layers if tp > 1 else 0
        self._fixed += n_ar * cal.allreduce_latency_s
        link = gpu.interconnect_bandwidth * cal.eta_link
        ring = 2.0 * (tp - 1) / tp if tp > 1 else 0.0
        self._ar_per_token = n_ar * ring * model.hidden_size * model.dtype_bytes / link
        self._dense_weight_s = model.streamed_weight_bytes(1.0) / tp / w_bw
        self._moe = model.is_moe

    @property
    def idle_step_s(self) -> float:
        """A step that schedules nothing (only the host's part)."""
        return self._fixed

    def weight_time(self, n_tokens: float) -> float:
        if not self._moe:
            return self._dense_weight_s
        return self.model.streamed_weight_bytes(n_tokens) / self.tp / self._w_bw

    def kv_slowdown(self, n_seqs: int) -> float:
        """KV streaming time relative to `eta_bw_kv` (1 with many attention work units, at most 2):
        the tail of kernels with few units per SM (Calibration.kv_tail_units_per_sm)."""
        tail = self._kv_tail_units
        if tail <= 0:
            return 1.0
        units = max(float(n_seqs * self._kv_heads), tail)
        return 1.0 + tail / units

    def step_time(self, n_tokens: int, n_seqs: int, ctx_tokens: float, attn_pairs: float) -> float:
        """One step: `ctx_tokens` = KV tokens read (context before the step, summed over the
        scheduled requests); `attn_pairs` = query-key pairs of the attention (Σ chunk x context)."""
        tail = self._kv_tail_units
        kv_s = self._kv_per_token_s
        if tail > 0:  # kv_slowdown, inlined: this runs for every step
            units = float(n_seqs * self._kv_heads)
            kv_s *= 1.0 + tail / (units if units > tail else tail)
        weights = self.weight_time(n_tokens) if self._moe else self._dense_weight_s
        mem = weights + kv_s * (ctx_tokens + n_tokens)
        comp = (
            self._s_per_token * n_tokens
            + self._s_per_logit * n_seqs
            + self._s_per_pair * attn_pairs
        )
        # The shorter term is exposed in the memory's share of the step (gemm_overlap_loss).
        lo = comp if mem > comp else mem
        gpu = (mem if mem > comp else comp) + self._loss * lo * mem / (mem + comp)
        return gpu + self._fixed + self._c_seq * n_seqs + self._ar_per_token * n_tokens

    def step_times(
        self, n_tokens: FloatArray, n_seqs: FloatArray, ctx_tokens: FloatArray, pairs: FloatArray
    ) -> FloatArray:
        """step_time over arrays of steps (the skip-ahead path and the constants' fitting)."""
        kv_s = self._kv_per_token_s * np.ones_like(n_seqs)
        tail = self._kv_tail_units
        if tail > 0:
            units = np.maximum(n_seqs * self._kv_heads, tail)
            kv_s = kv_s * (1.0 + tail / units)
        if self._moe:
            values, index = np.unique(n_tokens, return_inverse=True)
            weights = np.array([self.weight_time(float(v)) for v in values])[index]
        else:
            weights = np.full(n_tokens.shape, self._dense_weight_s)
        mem = weights + kv_s * (ctx_tokens + n_tokens)
        comp = self._s_per_token * n_tokens + self._s_per_logit * n_seqs + self._s_per_pair * pairs
        gpu = np.maximum(mem, comp) + self._loss * np.minimum(mem, comp) * mem / (mem + comp)
        out: FloatArray = gpu + self._fixed + self._c_seq * n_seqs + self._ar_per_token * n_tokens
        return out

    def decode_times(self, n_seqs: int, ctx0: float, steps: int) -> FloatArray:
        """`steps` consecutive pure-decode steps of `n_seqs` requests whose contexts sum to
        `ctx0` at the first step and grow by one token each per step (the skip-ahead path)."""
        ctx = ctx0 + np.arange(steps, dtype=np.float64) * n_seqs
        n = np.full(steps, float(n_seqs))
        # Decode attention: one query per request against its context plus itself.
        return self.step_times(n, n, ctx, ctx + n_seqs)
