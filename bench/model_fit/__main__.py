"""How right is the operator's performance model, at the loads where it must decide?

For a scenario and a few knob settings, run the live world at a constant per-replica rate
(fractions of the ground truth's capacity, overload included), take one Snapshot through the
operator's own Prometheus adapter, calibrate the default model on it, and compare its
predicted capacity for the observed knobs and for other knobs with the ground truth's.

    python -m bench.model_fit bench/scenarios/chat-8b-h100.yaml [--loads 0.6 1.0 1.5]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
from datetime import timedelta

from bench.tuning.methods import EPOCH, context, vllm_defaults
from bench.tuning.promsim import SimTransport
from bench.tuning.scenario import Scenario, load
from bench.tuning.truth import Truth
from bench.tuning.world import NAMESPACE, World, revision
from vllm_autotuner.adapters.prometheus import PrometheusSource
from vllm_autotuner.adapters.promql import SnapshotTarget
from vllm_autotuner.core.perf_model import AnalyticModel, Workload
from vllm_autotuner.core.snapshot import Snapshot
from vllm_autotuner.core.tuning_types import Knobs

WINDOW_S = 300.0
# The per-replica rate a configuration the ground truth serves at no rate is observed at.
# (Every other one runs at its --loads fractions of the truth's capacity. A floor of
# 0.2 req/s on every rate, as before, ran the held-out Qwen2.5-32B RAG deployment, whose
# capacity is 0.21, at 0.2 for both the 0.6 and the 1.0 load.)
NO_CAPACITY_RATE = 0.2


def observe(
    s: Scenario, knobs: Knobs, rate: float, seconds: float = 600.0, window_s: float = WINDOW_S
) -> Snapshot:
    """One evaluation window (`window_s`, ending at `seconds`) of the live world at a
    constant per-replica rate."""
    const = dataclasses.replace(s, workload={**s.workload, "rate": float(rate)})
    world = World(const, knobs, horizon_s=seconds)
    world.advance_to(seconds)
    source = PrometheusSource("http://prometheus.sim", window_grid_s=15.0)
    transport = SimTransport(world.db, offset=EPOCH.timestamp())
    pods, since = world.ready_pods(knobs)
    policy = s.policy("Auto")
    target = SnapshotTarget(
        namespace=NAMESPACE,
        name="bench",
        pods=tuple(pods),
        since=None if since is None else EPOCH + timedelta(seconds=since),
        knobs=knobs,
        revision=revision(knobs),
        window_s=window_s,
        slo=(policy.slo.ttft, policy.slo.itl, policy.slo.e2e),
        model_name=s.model,
    )
    loop = asyncio.new_event_loop()
    try:
        snaps = loop.run_until_complete(
            source._cycle(transport, [target], EPOCH + timedelta(seconds=seconds))
        )
    finally:
        loop.close()
    return snaps[target.key]


def candidates(s: Scenario, extra: list[str]) -> list[Knobs]:
    """vLLM's defaults, a few budgets around them, and `extra` ("tokens/seqs", at the
    defaults' utilisation; an oracle's or a tuner's choice, say)."""
    d = vllm_defaults(s)
    out = [d]
    for text in extra:
        mnbt, mns = (int(v) for v in text.split("/"))
        out.append(Knobs(mnbt, mns, d.gpu_memory_utilization))
    for mnbt, mns in ((2048, 256), (1024, 256), (512, 128), (4096, 512)):
        k = Knobs(mnbt, min(mns, mnbt), d.gpu_memory_utilization)
        if s.bounds.contains(k) and not k.same_as(d):
            out.append(k)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario")
    ap.add_argument("--loads", type=float, nargs="+", default=[0.6, 1.0, 1.5])
    ap.add_argument("--knobs", nargs="*", default=[], help="more knobs to predict: TOKENS/SEQS")
    args = ap.parse_args(argv)
    s = load(args.scenario)
    truth = Truth(s)
    ctx = context(s)
    policy = s.policy("Auto")
    ks = candidates(s, args.knobs)
    caps = {k: truth.capacity(k) for k in ks}
    errors: list[float] = []
    for k in ks:
        for load_f in args.loads:
            rate = caps[k] * load_f if caps[k] > 0 else NO_CAPACITY_RATE
            snap = observe(s, k, rate)
            if not snap.available:
                print(f"{k.describe()} at {rate:.2f}: unavailable ({snap.reason})")
                continue
            model = AnalyticModel(ctx.gpu_product)
            w = Workload.from_snapshot(snap, policy.slo, policy.safety_margin)
            cal = model.calibrate(snap, k, ctx, w, None)
            row = []
            for other in ks:
                p = model.predict(other, w, cal).capacity_rps
                err = p / caps[other] - 1.0 if caps[other] > 0 else float("nan")
                errors.append(abs(err))
                row.append(f"{other.max_num_batched_tokens}/{other.max_num_seqs}:{err:+.0%}")
            print(
                f"obs {k.max_num_batched_tokens}/{k.max_num_seqs} load {load_f:.1f} "
                f"({snap.per_pod_rate():.1f} req/s/pod, true cap {caps[k]:.1f}) -> "
                + " ".join(row),
                flush=True,
            )
    truth.save()
    if errors:
        print(
            f"|error| median {statistics.median(errors):.0%} worst {max(errors):.0%} "
            f"over {len(errors)} predictions",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
