"""`python -m bench.decide_cost`: CPU per decide() call, the number the operator's scale hangs on.

Every reconcile of a deployment with metrics runs decide(); at 1000 deployments and a 30 s
interval the event loop can afford about 30 ms of CPU per reconcile on one core. This prints the
cost of each kind of reconcile (steady with a fresh search, steady reusing the last search,
recommend, violated SLO) on the synthetic Llama-3.1-8B/H100 deployment of the core tests,
and a steady reconcile whose window has moved a little since the last (new samples: the step
-time fit runs again, the search memo still answers).

"first" is a deployment's first decision in a process that has not seen its like: the
process-wide step-curve, fit and prediction caches (perf_model.CURVE_CACHE, FIT_CACHE,
PREDICT_CACHE) are emptied before each sample, as for a deployment whose calibration no
other deployment shares. Without that, the repeats would fit the window once and reuse it
(what 1,000 identical deployments in bench.scale do, and a real fleet does not).
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

from tests.unit.core.test_decide import (
    CTX,
    KNOBS,
    NOW,
    make_policy,
    make_snapshot,
    ready_pods,
    violating_snapshot,
)

from vllm_autotuner.core import perf_model
from vllm_autotuner.core.decide import decide
from vllm_autotuner.core.perf_model import AnalyticModel
from vllm_autotuner.core.snapshot import Observation
from vllm_autotuner.core.tuning_types import TuningState


def _time(fn: Callable[[], object], repeat: int, cold: bool = False) -> tuple[float, float]:
    samples = []
    for _ in range(repeat):
        if cold:
            perf_model._fit_step_times.cache_clear()
            perf_model._shared_curve.cache_clear()
            perf_model._prediction.cache_clear()
        t0 = time.process_time()
        fn()
        samples.append(time.process_time() - t0)
    return statistics.median(samples), max(samples)


def main() -> int:
    repeat = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    model = AnalyticModel("H100")
    state = replace(TuningState.initial(KNOBS), phase="Observing")
    cases = {
        "Auto, healthy": (make_policy("Auto"), make_snapshot()),
        "Recommend, healthy": (make_policy("Recommend"), make_snapshot()),
        "Auto, ITL violated": (make_policy("Auto"), violating_snapshot()),
    }
    print(f"{'case':<28} {'first (ms)':>10} {'again (ms)':>10} {'max again':>10}")
    for name, (policy, snap) in cases.items():
        obs = Observation(snap, ready_pods(KNOBS))
        first = decide(state, obs, policy, CTX, NOW, model, KNOBS)
        fresh = functools.partial(decide, state, obs, policy, CTX, NOW, model, KNOBS)
        later = NOW + timedelta(seconds=30)
        # The memo of the first decision, as the controller hands it back (None after a
        # rollout: then "again" searches too).
        reuse = functools.partial(
            decide, state, obs, policy, CTX, later, model, KNOBS, first.search_memo
        )
        t_first, _ = _time(fresh, repeat, cold=True)
        t_again, t_max = _time(reuse, repeat)
        print(f"{name:<28} {t_first * 1e3:>10.1f} {t_again * 1e3:>10.1f} {t_max * 1e3:>10.1f}")
    print(f"{'Auto, healthy, moved window':<28} {'':>10} {_moved(state, model, repeat):>10.1f}")
    return 0


def _moved(state: TuningState, model: AnalyticModel, repeat: int) -> float:
    """Median ms of a steady decide() on a window 0.1 % slower than the last each time (the
    fit's memo misses), reusing the first decision's search memo."""
    policy = make_policy("Auto")
    first = decide(state, Observation(make_snapshot(), ready_pods(KNOBS)), policy, CTX, NOW,
                   model, KNOBS)  # fmt: skip
    later = NOW + timedelta(seconds=30)
    samples = []
    for i in range(1, repeat + 1):
        obs = Observation(make_snapshot(itl_mean=20.0 * (1 + 0.001 * i)), ready_pods(KNOBS))
        t0 = time.process_time()
        decide(state, obs, policy, CTX, later, model, KNOBS, first.search_memo)
        samples.append(time.process_time() - t0)
    return statistics.median(samples) * 1e3


if __name__ == "__main__":
    sys.exit(main())
