"""`python -m bench.canary_power SCENARIO`: how often the paired canary verdict promotes.

The canary's verdict compares one pod with the baseline pods over one window. Where a
pod serves few requests in that window, what each side measures is noisy, and the
capacity each is credited with (the model calibrated on its own window) more so. This
runs independent pairs of windows of the live world, the baseline pods at the scenario's
vLLM defaults and one canary pod at `--candidate`, and judges each pair exactly as the
operator's decide() does at the end of a canary's window (`core.canary.judge_canary`
with `decide._own_capacity`). With the candidate left at the defaults it is an A/A test:
every Promote is a change made on noise.

    python -m bench.canary_power bench/scenarios/chat-8b-h100.yaml [--candidate 768/560/0.92]
        [--load 0.8 | --rate R] [--window 600] [--pairs 10] [--out FILE.json]

Prints each pair as it is judged and then the verdicts' counts, the credited gains and
the ground truth's gain for the candidate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from bench.model_fit.__main__ import observe
from bench.tuning.methods import context, vllm_defaults
from bench.tuning.scenario import Scenario, load
from bench.tuning.truth import Truth
from vllm_autotuner.core.arrival_pool import pooled
from vllm_autotuner.core.canary import judge_canary
from vllm_autotuner.core.decide import (
    CANARY_WINDOW_FACTOR,
    _canary_min_requests,
    _own_capacity,
    _workload,
)
from vllm_autotuner.core.perf_model import AnalyticModel
from vllm_autotuner.core.tuning_types import Knobs

# Seeds of the pairs' worlds: the baseline's and the canary's, apart from each other and
# from the scenario's own.
BASE_SEED, CANARY_SEED = 300, 400


def parse_knobs(text: str) -> Knobs:
    """ "TOKENS/SEQS/UTILISATION" as the benchmark's tables print them."""
    try:
        mnbt, mns, gmu = text.split("/")
        return Knobs(int(mnbt), int(mns), float(gmu))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected TOKENS/SEQS/UTILISATION") from exc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario")
    ap.add_argument("--candidate", type=parse_knobs, help="the canary's knobs (the defaults)")
    ap.add_argument("--load", type=float, default=0.8, help="rate as a share of the truth's")
    ap.add_argument("--rate", type=float, help="req/s per pod (instead of --load)")
    ap.add_argument("--window", type=float, default=600.0, help="the paired window (s)")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--no-truth", action="store_true", help="skip the ground truth (needs --rate)")
    args = ap.parse_args(argv)
    if args.no_truth and args.rate is None:
        ap.error("--no-truth needs --rate: the load is a share of the truth's capacity")
    s = load(args.scenario)
    if s.replicas < 2:
        ap.error(f"{s.name} has {s.replicas} replica: a canary needs two or more")
    base_knobs = vllm_defaults(s)
    cand = args.candidate or base_knobs
    if not s.bounds.contains(cand):
        ap.error(f"{cand.describe()} is outside {s.name}'s bounds")
    true_gain = None
    if not args.no_truth:
        truth = Truth(s)
        cap_base, cap_cand = truth.capacity(base_knobs), truth.capacity(cand)
        truth.save()
        true_gain = cap_cand / cap_base - 1.0 if cap_base > 0 else None
    rate = args.rate if args.rate is not None else args.load * cap_base
    print(
        f"{s.name}: baseline {base_knobs.describe()}, canary {cand.describe()} (the truth's "
        f"gain {_pct(true_gain)}), {rate:.3f} req/s/pod, {args.window:.0f} s windows, "
        f"{args.pairs} pairs",
        flush=True,
    )
    rows = [_pair(s, base_knobs, cand, rate, args.window, k) for k in range(args.pairs)]
    summary = _summary(rows, true_gain)
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"pairs": rows, "summary": summary}, indent=1))
    return 0


def _pair(
    s: Scenario, base_knobs: Knobs, cand: Knobs, rate: float, window_s: float, k: int
) -> dict[str, object]:
    """One pair of windows, judged at the end of the canary's window. As the operator does,
    a window whose canary or baseline has too few requests runs on, up to
    CANARY_WINDOW_FACTOR windows."""
    policy, ctx = s.policy("Auto"), context(s)
    need = _canary_min_requests(policy, ctx)
    base_pods = s.replicas if s.rollout.max_surge else s.replicas - 1
    base_world = dataclasses.replace(s, seed=BASE_SEED + k, replicas=base_pods)
    canary_world = dataclasses.replace(s, seed=CANARY_SEED + k, replicas=1)
    for m in range(1, CANARY_WINDOW_FACTOR + 1):
        seconds = m * window_s
        base = observe(base_world, base_knobs, rate, seconds, seconds)
        can = observe(canary_world, cand, rate, seconds, seconds)
        if min(base.completed_requests, can.completed_requests) >= need:
            break
    model = AnalyticModel(ctx.gpu_product)
    # The deployment's burstiness as the operator pools it: here, the baseline's window alone.
    pool = pooled({}, base, 0.0, policy.evaluation_window_s)
    w = _workload(base, policy, policy.safety_margin, pool)
    prior = model.calibrate(base, base_knobs, ctx, w, None)
    cb, _ = _own_capacity(model, base, base_knobs, policy, ctx, prior, pool)
    cc, cautious = _own_capacity(model, can, cand, policy, ctx, prior, pool, True)
    j = judge_canary(base, can, policy.slo, need, cb, cc, policy.min_gain_pct, True, cautious)
    gain = cc / cb - 1.0 if cb and cc else None
    row: dict[str, object] = {
        "pair": k,
        "baseline_requests": base.completed_requests,
        "canary_requests": can.completed_requests,
        "window_s": seconds,
        "credited_gain": gain,
        "verdict": j.verdict,
        "reason": j.reason,
    }
    print(
        f"  pair {k}: {j.verdict:8s} credited {_pct(gain)} "
        f"({can.completed_requests} canary, {base.completed_requests} baseline requests in "
        f"{seconds:.0f} s): "
        f"{j.reason[:160]}",
        flush=True,
    )
    return row


def _summary(rows: list[dict[str, object]], true_gain: float | None) -> dict[str, object]:
    verdicts = [str(r["verdict"]) for r in rows]
    gains = [float(g) for r in rows if isinstance(g := r["credited_gain"], float)]
    return {
        "pairs": len(rows),
        "promoted": verdicts.count("Promote"),
        "rejected": verdicts.count("Reject"),
        "pending": verdicts.count("Pending"),
        "true_gain": true_gain,
        "credited_gain_median": statistics.median(gains) if gains else None,
        "credited_gain_min": min(gains) if gains else None,
        "credited_gain_max": max(gains) if gains else None,
        "credited_gains": len(gains),
    }


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.1%}"


if __name__ == "__main__":
    sys.exit(main())
