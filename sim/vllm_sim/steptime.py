"""How long one engine step takes: a roofline per GPU plus fixed host costs.

The step is memory-bound while it streams weights and KV (decode) and compute-bound once the
token budget is spent on prefill; which one wins is exactly the trade-off the token budget knob
moves, so the model must keep both terms and never beat either physical floor.
Formula: simulator-calibration.md §1.2.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from vllm_sim.catalog import GpuSpec, ModelSpec

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Calibration:
    """Every efficiency and overhead constant of the step-time model, in one place.

    First fitted (grid search, bench/sim_calibration_points.py) on the steady-state H100 serving
    runs of real-vllm-measurements.md §3 at 5-20 req/s. Then re-fitted by replaying every run of
    sim/vllm_sim/data/runs/calibration-h100.yaml through the engine (`python -m
    bench.fidelity.fit --quick`: coordinate descent on eta_bw_weights, eta_bw_kv, c_step_s,
    c_seq_s, allreduce_latency_s, eta_link, kv_tail_units_per_sm; objective: mean |log error|
    of TPOT and E2E on the steady stages plus half that of the completion-based throughput of
    the overloaded reasoning runs; 0.229 -> 0.199), with the prompts repeating as the client's
    shared_prefix data does (prefix caching hits whole prompts, see docs/fidelity.md); values
    rounded. Why the KV tail: one KV efficiency cannot serve both MHA Llama-2-7B (32 KV heads
    per rank; its KV streams at ~0.9 of peak between 8 and 20 req/s) and GQA 34B TP2 / 70B TP4
    (4 / 2 KV heads per rank; the marginal KV cost from 20 req/s to 128 long sequences implies
    ~0.5 of peak). With it, 70B TP4 saturates at 29.3 ms (measured 29.5) instead of 28.2, and
    its overload completes 3239 of 4800 requests (measured 3200; 3866 before). Result (python -m
    bench.fidelity): median |error| TPOT, E2E and TTFT p50 within 4%. Mixtral's saturated TPOT
    (37 ms measured against 20.5 at ~100 shorter sequences) stays out of reach: its cost from
    38 to 103 sequences is nearly flat, then +16 ms to 128 long ones, which no smooth term in
    batch or context reproduces (docs/fidelity.md). The 2024 CI fixed-batch points of
    simulator-calibration.md §1.2 predate async scheduling.
    """

    eta_bw_weights: float = 0.90  # achieved / peak HBM bandwidth while streaming weights
    eta_bw_kv: float = 0.83  # paged-attention KV reads and writes with many work units
    eta_mfu: float = 0.80  # achieved / peak dense FLOP/s (vidur's A100 34B TP2 prefill: 0.52)
    c_step_s: float = 0.88e-3  # host scheduling, sampling, launch per step (not hidden by async)
    c_seq_s: float = 17e-6  # per scheduled sequence (input prep, sampling; BLIS fit 4.4 us)
    allreduce_latency_s: float = 14e-6  # per all-reduce (two per layer) when TP > 1
    eta_link: float = 0.25  # achieved / peak interconnect bandwidth in MB-sized all-reduces
    # API server to engine core (tokenization, IPC) before a request can be scheduled: part of
    # TTFT, not of queue time. Fitted on the TTFT residual of the same runs once async
    # scheduling's extra step is modelled (the measured TTFT is client-side, so it also holds
    # HTTP and streaming).
    c_frontend_s: float = 4e-3
    # Fused-MoE expert GEMMs may run below the dense MFU; their FLOPs are divided by this.
    # Left at 1: Mixtral's steady TPOT fits without it, and no value reaches its saturated
    # point (cached prompts leave those steps memory-bound, where this term does nothing).
    eta_moe: float = 1.0
    # Decode attention runs one work unit per (sequence, KV head of this rank) and layer, without
    # splitting the context once there are enough units to fill the GPU (FlashAttention's
    # split-KV heuristic). A few long units per SM leave the tail of every attention kernel to a
    # handful of SMs, which costs about this many units' worth of streaming per SM: KV reads run
    # at eta_bw_kv * u / (u + kv_tail_units_per_sm * SMs), u = seqs x KV heads per rank (at
    # least the tail itself, where the split heuristic takes over, so never below half).
    # Fitted with the constants above (see the class doc). Llama-2-70B TP4 on H100 (2 KV heads
    # per rank, tail 0.4 x 132 = 53 units): 0.83 x 256 / (256 + 53) = 0.69 of peak at 128
    # sequences, 0.41 below 27; Llama-2-7B (32 per rank) 0.81 at 83. BLIS's H100 fit: ~0.51.
    kv_tail_units_per_sm: float = 0.4


CALIBRATION = Calibration()


class StepTimeModel:
    """Step durations for one model on one GPU type at one TP degree."""

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
        # Efficiencies can be moved by Reality, but never above the hardware peak.
        eta_w = min(1.0, cal.eta_bw_weights * bandwidth_efficiency)
        eta_kv = min(1.0, cal.eta_bw_kv * bandwidth_efficiency)
        eta_mfu = min(1.0, cal.eta_mfu * compute_efficiency)
        bw = gpu.hbm_bandwidth
        peak = gpu.bf16_flops
        self._w_bw = eta_w * bw
        self._kv_per_token_s = kv_bytes_per_token / (eta_kv * bw)
        self._kv_heads = model.kv_heads_per_rank(tp)
        self._kv_tail_units = cal.kv_tail_units_per_sm * gpu.sm_count
        moe_experts = model.num_experts_per_tok * model.expert_params * model.num_hidden_layers
        dense_part = model.active_params_per_token - (moe_experts if model.is_moe else 0)
        moe_part = moe_experts / cal.eta_moe if model.is_moe else 0.0
        self._flop_per_token = 2.0 * (dense_part + moe_part) / tp
        self._flop_per_logit = 2.0 * model.hidden_size * model.vocab_size / tp
        self._flop_per_pair = (
            4.0 * model.num_hidden_layers * model.num_attention_heads * model.head_dim / tp
        )
        self._compute_rate = eta_mfu * peak
        self._c_step = cal.c_step_s
        self._c_seq = cal.c_seq_s
        n_ar = 2 * model.num_hidden_layers if tp > 1 else 0
        self._ar_fixed = n_ar * cal.allreduce_latency_s
        link = gpu.interconnect_bandwidth * cal.eta_link
        ring = 2.0 * (tp - 1) / tp if tp > 1 else 0.0
        self._ar_per_token = n_ar * ring * model.hidden_size * model.dtype_bytes / link
        self._dense_weight_s = model.streamed_weight_bytes(1.0) / tp / self._w_bw
        self._moe = model.is_moe

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
        flops = (
            self._flop_per_token * n_tokens
            + self._flop_per_logit * n_seqs
            + self._flop_per_pair * attn_pairs
        )
        comp = flops / self._compute_rate
        return (
            (mem if mem > comp else comp)
            + self._c_step
            + self._c_seq * n_seqs
            + self._ar_fixed
            + self._ar_per_token * n_tokens
        )

    def decode_times(self, n_seqs: int, ctx0: float, steps: int) -> FloatArray:
        """`steps` consecutive pure-decode steps of `n_seqs` requests whose contexts sum to
        `ctx0` at the first step and grow by one token each per step (the skip-ahead path)."""
        i = np.arange(steps, dtype=np.float64)
        ctx = ctx0 + i * n_seqs
        kv_s = self._kv_per_token_s * self.kv_slowdown(n_seqs)
        mem = self.weight_time(n_seqs) + kv_s * (ctx + n_seqs)
        # Decode attention: one query per request against its context plus itself.
        pairs = ctx + n_seqs
        flops = (
            self._flop_per_token * n_seqs
            + self._flop_per_logit * n_seqs
            + self._flop_per_pair * pairs
        )
        comp = flops / self._compute_rate
        fixed = self._c_step + self._c_seq * n_seqs + self._ar_fixed + self._ar_per_token * n_seqs
        out: FloatArray = np.maximum(mem, comp) + fixed
        return out
