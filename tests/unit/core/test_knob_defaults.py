"""vLLM's per-GPU starting knobs (vLLM arg_utils.py): the tuner starts where `vllm serve` does."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_autotuner.core.knob_defaults import default_knobs, gpu_memory_gib


@pytest.mark.parametrize(
    ("product", "mnbt", "mns"),
    [
        # >= 70 GiB and not A100: the API-server tier 8192 / 1024.
        ("H100", 8192, 1024),
        ("NVIDIA-H100-80GB-HBM3", 8192, 1024),
        ("NVIDIA-H200", 8192, 1024),
        # >= 160 GiB: 16384 / 1024.
        ("B200", 16384, 1024),
        # A100 is excluded from the large tier whatever its memory (vLLM PR #17885).
        ("NVIDIA-A100-SXM4-80GB", 2048, 256),
        ("A100-40GB", 2048, 256),
        ("L40S", 2048, 256),
        # Unknown GPUs get the small tier, as vLLM does when it cannot query memory.
        ("SomethingNew", 2048, 256),
        (None, 2048, 256),
    ],
)
def test_api_server_tiers(product: str | None, mnbt: int, mns: int) -> None:
    k = default_knobs(product)
    assert (k.max_num_batched_tokens, k.max_num_seqs) == (mnbt, mns)
    assert k.gpu_memory_utilization == pytest.approx(0.92)


def test_explicit_memory_decides_the_tier() -> None:
    assert default_knobs("custom", 192.0).max_num_batched_tokens == 16384
    assert default_knobs("custom", 96.0).max_num_batched_tokens == 8192
    assert default_knobs("custom", 24.0).max_num_batched_tokens == 2048


def test_post_processing_caps_the_budget_by_max_model_len() -> None:
    # Step 5: mnbt = min(max_num_seqs * max_model_len, mnbt); step 6: mns = min(mns, mnbt).
    k = default_knobs("L40S", max_model_len=4)
    assert k.max_num_batched_tokens == 256 * 4
    assert k.max_num_seqs == 256


def test_throughput_mode_doubles_both() -> None:
    k = default_knobs("H100", performance_mode="throughput")
    assert (k.max_num_batched_tokens, k.max_num_seqs) == (16384, 2048)


@pytest.mark.parametrize(
    ("product", "gib"),
    [
        ("H100", 80),
        ("H200", 141),
        ("NVIDIA-A100-SXM4-40GB", 40),
        ("A100-80GB", 80),
        ("L40S", 48),
        ("B200", 180),
        ("nvidia-l4", 24),
        ("Unknown-Thing", None),
    ],
)
def test_gpu_memory_table(product: str, gib: float | None) -> None:
    assert gpu_memory_gib(product) == gib


@given(
    product=st.sampled_from(["H100", "H200", "A100", "L40S", "B200", "x"]),
    mml=st.one_of(st.none(), st.integers(1, 200_000)),
    mode=st.sampled_from(["balanced", "throughput", "interactivity"]),
)
def test_defaults_always_start(product: str, mml: int | None, mode: str) -> None:
    """vLLM refuses mnbt < max_num_seqs; the defaults must never produce that."""
    k = default_knobs(product, max_model_len=mml, performance_mode=mode)
    assert 1 <= k.max_num_seqs <= k.max_num_batched_tokens
