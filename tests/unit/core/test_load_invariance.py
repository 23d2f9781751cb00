"""Issue 19's property: a fit from a 60%-load window and one from a 150%-load window of the
same engine agree within 10%.

Both windows come from bench.tuning's live world (the simulator's engines behind the
scenario's replicas, at a constant per-replica rate of 0.6 and 1.5 times the ground truth's
capacity for the knobs), read through the operator's own Prometheus adapter
(bench/model_fit's `observe`). The default model is calibrated on each, and each fit's
predicted capacity for the observed knobs is compared. Calibration data (these windows) and
the check (the other window's fit) are different runs; the ground truth only sets the loads.

Where the property does not hold the case is a strict xfail carrying the measured numbers,
so that a model that starts to meet it turns the xfail into a failure to update.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from bench.model_fit.__main__ import observe
from bench.tuning.methods import context, vllm_defaults
from bench.tuning.scenario import Scenario, load
from bench.tuning.truth import Truth

from vllm_autotuner.core.perf_model import AnalyticModel, Workload
from vllm_autotuner.core.tuning_types import Knobs

AGREEMENT = 0.10
LOADS = (0.6, 1.5)


@dataclass(frozen=True)
class Case:
    scenario: str
    knobs: Knobs | None  # None: vLLM's defaults for the scenario's GPU


def capacities(case: Case) -> tuple[float, dict[float, float]]:
    """(the ground truth's capacity, {load: the fit's predicted capacity}) for the knobs."""
    s: Scenario = load(f"bench/scenarios/{case.scenario}.yaml")
    knobs = case.knobs or vllm_defaults(s)
    truth = Truth(s).capacity(knobs)
    ctx, policy = context(s), s.policy("Auto")
    fits: dict[float, float] = {}
    for load_factor in LOADS:
        snap = observe(s, knobs, truth * load_factor)
        assert snap.available, snap.reason
        model = AnalyticModel(ctx.gpu_product)
        w = Workload.from_snapshot(snap, policy.slo, policy.safety_margin)
        cal = model.calibrate(snap, knobs, ctx, w, None)
        fits[load_factor] = model.predict(knobs, w, cal).capacity_rps
    return truth, fits


def agree(case: Case) -> None:
    truth, fits = capacities(case)
    low, high = fits[LOADS[0]], fits[LOADS[1]]
    assert low > 0 and high > 0
    assert abs(high / low - 1.0) <= AGREEMENT, (
        f"{case}: truth {truth:.2f}, fit at 60% {low:.2f}, at 150% {high:.2f} req/s/pod"
    )


def xfail(measured: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=f"measured, capacity req/s/pod: {measured}")


@pytest.mark.parametrize(
    "case",
    [
        # Was a strict xfail (truth 18.52; fit at 60 % load 23.61, at 150 % 20.45: 0.866x)
        # until Little's law ran on the sample path's own mean step (17.76 and 16.91: 0.952x).
        pytest.param(Case("chat-8b-h100", None), id="chat-8b-h100-defaults"),
        pytest.param(Case("kv-bound-8b-a100-40gb", None), id="kv-bound-defaults"),
    ],
)
def test_fits_from_a_quiet_and_an_overloaded_window_agree(case: Case) -> None:
    agree(case)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        # Strict xfails until the eighth session's sample path (the walk in order, the prefill
        # time in the fit, the prefix attention): chat-2048 was 0.838x (truth 17.93; 19.36,
        # 16.22), tight-itl's defaults 1.291x (6.87; 4.54, 5.85), tight-itl-2048 1.297x
        # (6.41; 5.11, 6.63). Now 1.019x (16.62; 17.70, 18.03), 1.073x (6.48; 6.01, 6.45) and
        # 0.997x (6.37; 6.05, 6.03), against the steady-state truth.
        pytest.param(Case("chat-8b-h100", Knobs(2048, 256, 0.92)), id="chat-2048"),
        pytest.param(Case("tight-itl-8b-h100", None), id="tight-itl-defaults"),
        pytest.param(Case("tight-itl-8b-h100", Knobs(2048, 256, 0.92)), id="tight-itl-2048"),
        pytest.param(
            Case("rag-8b-a100", None),
            marks=xfail("truth 1.16; 60% 1.01, 150% 1.19 (1.184x); before: 0.91, 1.13 (1.245x)"),
            id="rag-defaults",
        ),
        pytest.param(
            Case("rag-8b-a100", Knobs(1024, 256, 0.92)),
            marks=xfail("truth 0.81; 60% 0.96, 150% 1.13 (1.171x); before: 1.08, 1.23 (1.133x)"),
            id="rag-1024",
        ),
        pytest.param(Case("kv-bound-8b-a100-40gb", Knobs(1024, 256, 0.92)), id="kv-bound-1024"),
        pytest.param(
            Case("bursty-8b-h100", None),
            marks=xfail(
                "truth 22.02; 60% 17.50, 150% 19.72 (1.127x); agreed within 10% before the "
                "eighth session's sample path (bursts the Poisson path does not have)"
            ),
            id="bursty-defaults",
        ),
        pytest.param(
            Case("bursty-8b-h100", Knobs(2048, 256, 0.92)),
            marks=xfail("truth 22.02; 60% 17.83, 150% 20.34 (1.141x); before: 16.66, 18.96"),
            id="bursty-2048",
        ),
    ],
)
def test_fits_agree_on_more_scenarios(case: Case) -> None:
    agree(case)
