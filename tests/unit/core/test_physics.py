"""The engine physics under the model (core/physics.py): KV capacity and step times.

- KV capacity is what the simulator's vLLM start-up would allocate (the same blocks), grows
  with gpu_memory_utilization, and is None exactly where vLLM would refuse to start; the
  utilisations at which it starts form one interval;
- step time grows with the tokens of a step and shrinks as the efficiencies grow;
- GPU product labels map to the simulator's catalog; unknown models and GPUs fall back and
  say so.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_autotuner.core.physics import (
    _TOKEN_GRID,
    FALLBACK_GPU,
    DeploymentShape,
    Physics,
    lognormal_sigma,
    sim_gpu_name,
)
from vllm_sim.engine import Engine
from vllm_sim.types import Reality, StartupError

SHAPES = [
    DeploymentShape("meta-llama/Llama-3.1-8B-Instruct", "NVIDIA-H100-80GB-HBM3", 1, 8192),
    DeploymentShape("meta-llama/Llama-3.1-8B-Instruct", "NVIDIA-A100-SXM4-40GB", 1, 32768),
    DeploymentShape("meta-llama/Llama-3.1-70B-Instruct", "NVIDIA-H200", 4, 16384),
    DeploymentShape("meta-llama/Llama-3.1-70B-Instruct", "NVIDIA-H100-80GB-HBM3", 1, 8192),
    DeploymentShape("Qwen/Qwen2.5-7B-Instruct", "NVIDIA-L40S", 1, None, "fp8"),
]
MOE_SHAPE = DeploymentShape("mistralai/Mixtral-8x7B-Instruct-v0.1", "NVIDIA-H200", 2, 8192)
shapes = st.sampled_from(SHAPES)
budgets = st.sampled_from([256, 512, 2048, 8192, 16384])
seqs = st.sampled_from([16, 128, 256, 1024])


@pytest.mark.parametrize(
    ("label", "name"),
    [
        ("NVIDIA-H100-80GB-HBM3", "H100"),
        ("NVIDIA-A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA-A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA-A100", "A100-80GB"),
        ("Tesla-A100-PCIE-40GB", "A100-40GB"),
        ("NVIDIA-H200", "H200"),
        ("nvidia_l40s", "L40S"),
        ("NVIDIA-GeForce-RTX-4090", None),
        ("", None),
        (None, None),
    ],
)
def test_gpu_labels_map_to_the_catalog(label: str | None, name: str | None) -> None:
    assert sim_gpu_name(label) == name


def test_unknown_models_and_gpus_fall_back_and_say_so() -> None:
    exact = Physics.of(SHAPES[0])
    assert exact.exact and exact.gpu_name == "H100"
    odd = Physics.of(DeploymentShape("acme/unknown-13b", "NVIDIA-GeForce-RTX-4090"))
    assert not odd.exact and odd.gpu_name == FALLBACK_GPU
    # 64 attention heads do not split over 3 GPUs: one GPU's physics, flagged.
    tp3 = Physics.of(DeploymentShape("meta-llama/Llama-3.1-70B-Instruct", "NVIDIA-H200", 3))
    assert not tp3.exact and tp3.shape.tensor_parallel_size == 1


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.model.split('/')[-1]}-{s.gpu_product}")
@pytest.mark.parametrize("gmu", [0.5, 0.9, 0.95])
def test_kv_capacity_is_what_the_engine_allocates(shape: DeploymentShape, gmu: float) -> None:
    phys = Physics.of(shape)
    cfg = phys.config(2048, 256, gmu)
    try:
        engine = Engine(cfg, Reality(), seed=0, record_itl=False)
    except (StartupError, ValueError):
        assert phys.kv_tokens(2048, 256, gmu) is None
        return
    kv = phys.kv_tokens(2048, 256, gmu)
    assert kv == engine.kv.num_gpu_blocks * engine.kv.block_size


@given(
    shape=shapes, mnbt=budgets, mns=seqs, g=st.lists(st.floats(0.3, 0.999), min_size=3, max_size=3)
)
def test_kv_capacity_grows_with_memory_and_starts_on_one_interval(
    shape: DeploymentShape, mnbt: int, mns: int, g: list[float]
) -> None:
    phys = Physics.of(shape)
    low, mid, high = sorted(g)
    kv = [phys.kv_tokens(mnbt, mns, x) for x in (low, mid, high)]
    if kv[0] is not None and kv[1] is not None:
        assert kv[1] >= kv[0]
    if kv[1] is not None and kv[2] is not None:
        assert kv[2] >= kv[1]
    # vLLM starts on an interval of utilisations: enough for weights and activations, not
    # more than the GPU has free.
    if kv[0] is not None and kv[2] is not None:
        assert kv[1] is not None
    for x, tokens in zip((low, mid, high), kv, strict=True):
        assert tokens is None or tokens > 0
        assert (tokens is None) == (not _engine_starts(phys, mnbt, mns, x))


def _engine_starts(phys: Physics, mnbt: int, mns: int, gmu: float) -> bool:
    try:
        Engine(phys.config(mnbt, mns, round(gmu, 4)), Reality(), seed=0, record_itl=False)
    except (StartupError, ValueError):
        return False
    return True


def test_a_70b_model_does_not_start_on_one_h100_and_more_memory_means_more_cache() -> None:
    one = Physics.of(SHAPES[3])
    assert all(one.kv_tokens(2048, 256, g) is None for g in (0.5, 0.9, 0.99))
    eight = Physics.of(SHAPES[0])
    a, b = eight.kv_tokens(2048, 256, 0.85), eight.kv_tokens(2048, 256, 0.95)
    assert a is not None and b is not None and b > a
    # The difference is a tenth of 80 GiB, at 128 KiB per token (8B: 32 layers x 8 KV heads
    # x 128 x 2 x 2 bytes).
    assert (b - a) * eight.kv_bytes_per_token == pytest.approx(0.1 * 80 * 2**30, rel=0.02)
    assert eight.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2


@given(
    shape=shapes,
    n_seqs=st.floats(1.0, 512.0),
    ctx=st.floats(0.0, 8000.0),
    t1=st.floats(0.0, 16384.0),
    t2=st.floats(0.0, 16384.0),
    eff=st.floats(1.05, 3.0),
)
def test_steps_grow_with_tokens_and_shrink_with_efficiency(
    shape: DeploymentShape, n_seqs: float, ctx: float, t1: float, t2: float, eff: float
) -> None:
    phys = Physics.of(shape)
    tokens = sorted((t1 + n_seqs, t2 + n_seqs))
    curve = phys.step_curve(1.0, 1.0, n_seqs, ctx)
    short, long = (float(v) for v in curve(tokens))  # type: ignore[arg-type]
    assert 0.0 < short <= long
    faster = phys.step_curve(eff, eff, n_seqs, ctx)
    assert float(faster(tokens)[1]) <= long * (1 + 1e-9)  # type: ignore[arg-type]


@given(mean=st.floats(1.0, 1e5), ratio=st.floats(1.0, 20.0))
def test_lognormal_sigma_reproduces_the_p90_when_it_can(mean: float, ratio: float) -> None:
    sigma = lognormal_sigma(mean, mean * ratio)
    assert 0.05 <= sigma <= 1.2816
    p90 = math.exp(math.log(mean) - 0.5 * sigma * sigma + 1.2816 * sigma)
    if 1.0001 < ratio < math.exp(1.2816**2 / 2) * 0.999 and sigma > 0.05:
        assert p90 == pytest.approx(mean * ratio, rel=1e-6)


def _step_curve_point_by_point(
    phys: Physics, bandwidth: float, compute: float, n_seqs: float, ctx_per_seq: float
) -> list[float]:
    """The curve's grid values as one `step_time` call per point (how it was computed before
    the array pass), the reference the array pass must match exactly."""
    sm = phys.step_model(bandwidth, compute)
    seqs = max(1, round(n_seqs))
    ctx = max(0.0, n_seqs * ctx_per_seq)
    out = []
    for n in _TOKEN_GRID + max(1.0, n_seqs):
        chunk = max(0.0, n - n_seqs)
        pairs = ctx + n_seqs + 0.5 * chunk * chunk
        out.append(sm.step_time(int(n), seqs + (1 if n > n_seqs + 0.5 else 0), ctx, pairs))
    return list(np.maximum.accumulate(out))


@given(
    shape=st.sampled_from([*SHAPES, MOE_SHAPE]),
    n_seqs=st.floats(0.0, 1100.0),
    ctx=st.floats(0.0, 40000.0),
    eff=st.tuples(st.floats(0.2, 5.0), st.floats(0.2, 5.0)),
)
def test_the_step_curve_is_the_step_time_model_at_every_grid_point(
    shape: DeploymentShape, n_seqs: float, ctx: float, eff: tuple[float, float]
) -> None:
    """Bit for bit: a fitted calibration can turn on the last digit of a step time."""
    phys = Physics.of(shape)
    grid = _TOKEN_GRID + max(1.0, n_seqs)
    curve = phys.step_curve(eff[0], eff[1], n_seqs, ctx)
    assert list(curve(grid)) == _step_curve_point_by_point(phys, eff[0], eff[1], n_seqs, ctx)
