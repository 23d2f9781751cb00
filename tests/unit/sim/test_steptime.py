"""The step-time roofline never beats physics and moves the way the knobs say it should."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from vllm_sim.catalog import MODEL_CONFIGS, gpu_names, load_gpu, load_model, quantization_from_flag
from vllm_sim.steptime import CALIBRATION, StepTimeModel


def floor_seconds(name: str, gpu_name: str, tp: int, n_tokens: int, ctx: int) -> float:
    """Bytes at peak bandwidth and FLOPs at peak compute, computed from config.json alone.

    Lower bounds only: MoE counts just the experts the tokens must touch (top-k), attention
    FLOPs are left out.
    """
    c = MODEL_CONFIGS[name]
    c = {**c, **c.get("text_config", {})}  # a multimodal config's language model
    h, inter, layers, vocab = (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                               c["vocab_size"])  # fmt: skip
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    attn = h * (2 * heads * 128 + 2 * kv * 128)
    # routed experts per token, plus Llama-4's shared expert (its config has intermediate_size_mlp)
    experts = c.get("num_experts_per_tok", 1) + (1 if "intermediate_size_mlp" in c else 0)
    per_token_params = layers * (attn + experts * 3 * h * inter)
    weight_bytes = (per_token_params + vocab * h) * 2 / tp
    kv_bytes = ctx * 2 * layers * max(1, kv // tp) * 128 * 2
    gpu = load_gpu(gpu_name)
    flops = 2 * per_token_params * n_tokens / tp
    return max((weight_bytes + kv_bytes) / gpu.hbm_bandwidth, flops / gpu.bf16_flops)


def model_for(name: str, gpu: str, tp: int) -> StepTimeModel:
    m = load_model(name)
    return StepTimeModel(m, load_gpu(gpu), tp, m.kv_bytes_per_token(tp, 2))


SHAPES = [  # (tokens, seqs, context read)
    (1, 1, 0),
    (1, 1, 4000),
    (8, 8, 8 * 160),
    (256, 256, 256 * 800),
    (512, 1, 0),
    (2048, 1, 0),
    (8192, 4, 6000),
    (16384, 2, 0),
]


@pytest.mark.parametrize(
    ("name", "gpu", "tp"),
    [(n, g, tp) for n, g, tp in itertools.product(sorted(MODEL_CONFIGS), gpu_names(), (1, 2, 4, 8))
     if load_model(n).num_attention_heads % tp == 0],
)  # fmt: skip
def test_never_beats_the_physical_floor(name: str, gpu: str, tp: int) -> None:
    st = model_for(name, gpu, tp)
    for n, seqs, ctx in SHAPES:
        pairs = ctx + n * (n + 1) / 2
        t = st.step_time(n, seqs, ctx, pairs)
        assert t >= floor_seconds(name, gpu, tp, n, ctx), (n, seqs, ctx)
    # the vectorised decode path obeys the same floor
    times = st.decode_times(64, 64 * 500, 5)
    for i, t in enumerate(times):
        assert t >= floor_seconds(name, gpu, tp, 64, 64 * 500 + i * 64)


def test_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    st = model_for("meta-llama/Llama-3.1-8B-Instruct", "H100", 1)
    one = st.step_time(1, 1, 100, 101)
    eight = st.step_time(8, 8, 800, 808)
    assert eight < 1.2 * one  # batching decodes is nearly free: weights dominate
    p1k = st.step_time(1024, 1, 0, 1024 * 1025 / 2)
    p8k = st.step_time(8192, 1, 0, 8192 * 8193 / 2)
    assert p8k > 6 * (p1k - 0.004)  # compute grows with tokens once weights are amortised
    # Roofline of the weights: 1024-token prefill of 8B on H100 roughly 25-35 ms
    assert 0.015 < p1k < 0.045


def test_more_context_and_more_tokens_take_longer() -> None:
    st = model_for("Qwen/Qwen2.5-32B-Instruct", "A100-80GB", 2)
    assert st.step_time(64, 64, 64 * 2000, 64 * 2001) > st.step_time(64, 64, 64 * 200, 64 * 201)
    ts = [st.step_time(n, 1, 0, n * (n + 1) / 2) for n in (128, 512, 2048, 8192)]
    assert ts == sorted(ts)


def test_vectorised_decode_matches_step_by_step() -> None:
    st = model_for("mistralai/Mixtral-8x7B-Instruct-v0.1", "H100", 2)
    d, ctx0 = 37, 37 * 611
    fast = st.decode_times(d, ctx0, 50)
    slow = [st.step_time(d, d, ctx0 + i * d, ctx0 + i * d + d) for i in range(50)]
    np.testing.assert_allclose(fast, slow, rtol=1e-12)


def test_tensor_parallel_speeds_up_but_adds_communication() -> None:
    one = model_for("meta-llama/Llama-3.1-70B-Instruct", "H100", 4)
    two = model_for("meta-llama/Llama-3.1-70B-Instruct", "H100", 8)
    t4 = one.step_time(32, 32, 32 * 1000, 32 * 1001)
    t8 = two.step_time(32, 32, 32 * 1000, 32 * 1001)
    assert t8 < t4 < 2 * t8  # not a perfect halving


def test_reality_efficiencies_slow_the_matching_regime() -> None:
    m = load_model("meta-llama/Llama-3.1-8B-Instruct")
    gpu = load_gpu("H100")
    kvb = m.kv_bytes_per_token(1, 2)
    base = StepTimeModel(m, gpu, 1, kvb)
    slow_bw = StepTimeModel(m, gpu, 1, kvb, bandwidth_efficiency=0.5)
    slow_mfu = StepTimeModel(m, gpu, 1, kvb, compute_efficiency=0.5)
    decode = (8, 8, 8000, 8008)
    prefill = (8192, 1, 0, 8192 * 8193 / 2)
    assert slow_bw.step_time(*decode) > 1.5 * base.step_time(*decode) - 0.01
    # prefill is compute-bound: slower memory shows only through the unhidden part
    assert slow_bw.step_time(*prefill) == pytest.approx(base.step_time(*prefill), rel=0.05)
    a100 = StepTimeModel(m, load_gpu("A100-80GB"), 1, kvb)  # synchronous MMAs: no overlap
    a100_slow = StepTimeModel(m, load_gpu("A100-80GB"), 1, kvb, compute_efficiency=0.5)
    assert a100_slow.step_time(*decode) > a100.step_time(*decode)
    assert slow_mfu.step_time(*prefill) > 1.7 * base.step_time(*prefill) - 0.01
    # decode is memory-bound: slower tensor cores show only through the unhidden GEMM part
    assert base.step_time(*decode) <= slow_mfu.step_time(*decode) < 1.1 * base.step_time(*decode)


def _with_tail(name: str, gpu: str, tp: int, tail: float) -> StepTimeModel:
    m = load_model(name)
    cal = replace(CALIBRATION, kv_tail_units_per_sm=tail)
    return StepTimeModel(m, load_gpu(gpu), tp, m.kv_bytes_per_token(tp, 2), calibration=cal)


def test_kv_tail_is_bounded_and_fades_with_many_attention_units() -> None:
    """The KV tail only ever slows KV reads, by at most 2x, and vanishes with many units."""
    mha = _with_tail("meta-llama/Llama-2-7b-hf", "H100", 1, 1.0)  # 32 KV heads per rank
    gqa = _with_tail("meta-llama/Llama-2-70b-hf", "H100", 4, 1.0)  # 2 KV heads per rank
    for st in (mha, gqa):
        s = [st.kv_slowdown(n) for n in (1, 2, 8, 32, 64, 128, 256, 1024)]
        assert all(1.0 <= x <= 2.0 for x in s)
        assert s == sorted(s, reverse=True)  # more sequences, more units, a smaller tail
    assert mha.kv_slowdown(128) < 1.05  # 4096 units on 132 SMs: the old constant holds
    assert gqa.kv_slowdown(128) > 1.4  # 256 units: the tail is a large part of the kernel
    assert gqa.kv_slowdown(128) > mha.kv_slowdown(128)
    off = _with_tail("meta-llama/Llama-2-70b-hf", "H100", 4, 0.0)
    assert off.kv_slowdown(128) == 1.0  # without the term, eta_bw_kv as before


def test_kv_tail_grows_with_the_gpus_sm_count() -> None:
    a100 = _with_tail("meta-llama/Llama-2-70b-hf", "A100-80GB", 4, 1.0)  # 108 SMs
    h100 = _with_tail("meta-llama/Llama-2-70b-hf", "H100", 4, 1.0)  # 132 SMs
    assert a100.kv_slowdown(128) < h100.kv_slowdown(128)


def test_kv_tail_only_touches_the_kv_part_of_a_step() -> None:
    """Same step with and without the tail: the difference is exactly the extra KV streaming."""
    name, tp, n, ctx = "codellama/CodeLlama-34b-Instruct-hf", 2, 128, 128 * 1800
    on = _with_tail(name, "H100", tp, 1.0)
    off = _with_tail(name, "H100", tp, 0.0)
    t_on = on.step_time(n, n, ctx, ctx + n)
    t_off = off.step_time(n, n, ctx, ctx + n)
    m = load_model(name)
    gpu = load_gpu("H100")
    kv_bw = CALIBRATION.eta_bw_kv * gpu.achievable_bandwidth
    kv_s = (ctx + n) * m.kv_bytes_per_token(tp, 2) / kv_bw
    assert t_on - t_off == pytest.approx(kv_s * (on.kv_slowdown(n) - 1.0), rel=1e-9)


@pytest.mark.parametrize("gpu", gpu_names())
@pytest.mark.parametrize(
    "name", ["meta-llama/Llama-3.1-8B-Instruct", "mistralai/Mixtral-8x7B-Instruct-v0.1"]
)
def test_fp8_weights_never_beat_their_own_floor_and_decode_faster(name: str, gpu: str) -> None:
    """FP8 weights: half the bytes and, where the GPU has them, FP8 tensor cores; the floor
    moves with them (bytes at the stored size, FLOPs at the FP8 peak) and is never beaten."""
    bf16 = load_model(name)
    fp8 = replace(bf16, quant=quantization_from_flag("fp8"))
    g = load_gpu(gpu)
    st16 = StepTimeModel(bf16, g, 2, bf16.kv_bytes_per_token(2, 2))
    st8 = StepTimeModel(fp8, g, 2, fp8.kv_bytes_per_token(2, 2))
    peak = g.fp8_flops or g.bf16_flops
    for n, seqs, ctx in SHAPES:
        pairs = ctx + n * (n + 1) / 2
        t = st8.step_time(n, seqs, ctx, pairs)
        weights = fp8.streamed_weight_bytes(n) / 2
        kv = ctx * fp8.kv_bytes_per_token(2, 2)
        assert t >= (weights + kv) / g.hbm_bandwidth
        assert t >= 2 * fp8.active_params_per_token * n / 2 / peak
    decode = (16, 16, 16 * 600, 16 * 601)
    assert st8.step_time(*decode) < 0.9 * st16.step_time(*decode)
