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
    c_seq_s, allreduce_latency_s, eta_link; objective: mean |log error| of TPOT and E2E on the
    steady stages plus the completion-based throughput of the overloaded reasoning runs), with
    the prompts repeating as the client's shared_prefix data does (prefix caching hits whole
    prompts, see docs/fidelity.md); eta_bw_kv then chosen on full-length replays (0.72 / 0.80 /
    0.85 / 0.90 score 0.242 / 0.228 / 0.242 / 0.266). What moved: KV reads below the weights'
    efficiency, a per-sequence cost near 16 us, all-reduces costing ~20 us plus MB-sized
    transfers at ~30% of NVLink peak. One constant cannot serve both MHA Llama-2-7B (its KV
    streams at ~0.86 of peak at 20 req/s) and GQA 34B/70B with 2-4 KV heads per rank at 128
    long sequences (~0.5): 0.80 leaves the first ~30% slow at its knee and the second ~20% fast
    when saturated. Result (python -m bench.fidelity): median |error| TPOT, E2E and TTFT p50
    within 5%; Mixtral's saturated TPOT (37 ms measured) is far above any shared constants.
    The 2024 CI fixed-batch points of simulator-calibration.md §1.2 predate async scheduling.
    """

    eta_bw_weights: float = 0.90  # achieved / peak HBM bandwidth while streaming weights
    eta_bw_kv: float = 0.80  # paged-attention KV reads and writes (BLIS's H100 fit: ~0.51)
    eta_mfu: float = 0.80  # achieved / peak dense FLOP/s (vidur's A100 34B TP2 prefill: 0.52)
    c_step_s: float = 0.9e-3  # host scheduling, sampling, launch per step (not hidden by async)
    c_seq_s: float = 16e-6  # per scheduled sequence (input prep, sampling; BLIS fit 4.4 us)
    allreduce_latency_s: float = 20e-6  # per all-reduce (two per layer) when TP > 1
    eta_link: float = 0.3  # achieved / peak interconnect bandwidth in MB-sized all-reduces
    # API server to engine core (tokenization, IPC) before a request can be scheduled: part of
    # TTFT, not of queue time. Fitted on the TTFT residual of the same runs once async
    # scheduling's extra step is modelled (the measured TTFT is client-side, so it also holds
    # HTTP and streaming).
    c_frontend_s: float = 4e-3
    # Fused-MoE expert GEMMs may run below the dense MFU; their FLOPs are divided by this.
    # Left at 1: Mixtral's measured TPOT fits without it (its TTFT stays ~30% low).
    eta_moe: float = 1.0


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

    def step_time(self, n_tokens: int, n_seqs: int, ctx_tokens: float, attn_pairs: float) -> float:
        """One step: `ctx_tokens` = KV tokens read (context before the step, summed over the
        scheduled requests); `attn_pairs` = query-key pairs of the attention (Σ chunk x context)."""
        mem = self.weight_time(n_tokens) + self._kv_per_token_s * (ctx_tokens + n_tokens)
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
        mem = self.weight_time(n_seqs) + self._kv_per_token_s * (ctx + n_seqs)
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
