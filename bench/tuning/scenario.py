"""Benchmark scenarios: one YAML file each, read into a frozen `Scenario`.

A scenario is everything a run needs and nothing a method may peek at selectively: the
deployment (model, GPU, TP, replicas, model loading time), the traffic, the SLO policy with its
bounds, the horizon and seed, and the hidden `reality` that only the ground truth (the simulated
GPUs) sees. Its `key` hashes the file's content, so cached ground truth is invalidated by any
edit. Format (every key but `name`, `model` and `workload` has a default)::

    name: chat-8b-h100                  # used in file names and tables
    description: free text
    model: meta-llama/Llama-3.1-8B-Instruct   # a vllm_sim catalog name
    gpu: H100                           # a vllm_sim catalog GPU
    tensor_parallel_size: 1
    max_model_len: 8192
    replicas: 2                         # pods of the deployment (one engine each)
    load_time_s: 120                    # a restart: container start + model loading until ready
    rollout:                            # how the cluster rolls a change out (RolloutSettings)
      max_surge: 0                      #   extra pods (and GPUs) a rollout may add; the cluster
                                        #   has replicas + max_surge GPUs
      canary: true                      #   with 2+ replicas a candidate runs first on one pod
      shutdown_timeout_s: 120           #   vLLM's --shutdown-timeout: drain of every restart
      pre_stop_s: 5                     #   pre-stop delay before SIGTERM (pod already unrouted)
    horizon_s: 10800                    # virtual seconds of live traffic per method
    seed: 1
    workload:                           # vllm_sim WorkloadSpec dict (see vllm_sim.workload);
      preset: chat                      #   `rate` is PER REPLICA, the run scales it by replicas;
      rate: {steps: [[0, 6], [3600, 9]]}  #   `duration` and `seed` come from horizon_s and seed
    slo:                                # percentile in percent, threshold in ms
      ttft: {percentile: 95, threshold_ms: 500}
      itl: {percentile: 95, threshold_ms: 50}
      e2e: null
    bounds:                             # the policy's bounds (every method stays inside them)
      max_num_batched_tokens: {min: 256, max: 16384, max_step: 8192}
      max_num_seqs: {min: 16, max: 1024, max_step: 512}
      gpu_memory_utilization: {min: 0.80, max: 0.97, max_step: 0.05}
    policy:                             # the operator's rollout rules (seconds)
      evaluation_window_s: 300
      verify_window_s: 600
      min_interval_s: 900
      max_per_day: 12
      min_requests_per_window: 200
      safety_margin: 0.9
      min_gain_pct: 5
      gmu_rise_step: 0.02
    reality:                            # vllm_sim.types.Reality fields, hidden from every tuner
      bandwidth_efficiency: 0.9
      compute_efficiency: 0.85
      per_request_overhead_s: 0.002
      step_jitter: 0.05
      oom_above_utilization: 0.94
      oom_min_batched_tokens: 4096
      oom_mean_time_s: 600
    truth:                              # how ground-truth capacity is measured (optional)
      requests: 1000                    #   requests per evaluation run
      seed: 11
    autoscaler:                         # optional: a replica autoscaler owns the count, and the
      min_replicas: 1                   #   run compares scaling signals (AutoscalerSpec in
      max_replicas: 8                   #   bench/tuning/autoscaler.py); `replicas` is then the
      utilization: 0.8                  #   starting count and the rate's multiplier
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.tuning.autoscaler import AutoscalerSpec
from vllm_autotuner.core.tuning_types import (
    SLO,
    Bounds,
    KnobBounds,
    RolloutRules,
    RolloutSettings,
    SLOTarget,
    TuningPolicy,
)
from vllm_sim import steptime
from vllm_sim.types import Reality
from vllm_sim.workload import WorkloadSpec

# How bench/tuning/truth.py measures a capacity; part of the truth cache's key, so that a
# change of method never reuses capacities measured the old way.
TRUTH_MEASURE = "time-sized runs: warm-up, measured window, cool-down (2026-12-06)"

_KNOWN = {
    "name", "description", "model", "gpu", "tensor_parallel_size", "max_model_len", "replicas",
    "load_time_s", "horizon_s", "seed", "workload", "slo", "bounds", "policy", "reality", "truth",
    "rollout", "autoscaler",
}  # fmt: skip
_ROLLOUT_KEYS = ("max_surge", "canary", "shutdown_timeout_s", "pre_stop_s")
_POLICY_DEFAULTS: dict[str, float] = {
    "evaluation_window_s": 300.0,
    "verify_window_s": 600.0,
    "min_interval_s": 900.0,
    "max_per_day": 12,
    "min_requests_per_window": 200,
    "safety_margin": 0.9,
    "min_gain_pct": 5.0,
    "gmu_rise_step": 0.02,
    "ready_timeout_s": 1800.0,
}


def _target(raw: Any) -> SLOTarget | None:
    if raw is None:
        return None
    return SLOTarget(float(raw["percentile"]), float(raw["threshold_ms"]))


def _bounds(raw: Mapping[str, Any]) -> Bounds:
    def one(key: str, lo: float, hi: float, step: float) -> KnobBounds:
        d = raw.get(key) or {}
        return KnobBounds(
            float(d.get("min", lo)), float(d.get("max", hi)), float(d.get("max_step", step))
        )

    return Bounds(
        mnbt=one("max_num_batched_tokens", 256, 16384, 8192),
        mns=one("max_num_seqs", 16, 1024, 512),
        gmu=one("gpu_memory_utilization", 0.8, 0.95, 0.05),
    )


def _number(section: str, key: str, value: Any) -> float:
    """A finite, non-negative number, or a ValueError naming the key."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{section}.{key} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{section}.{key} must be finite and >= 0, got {value!r}")
    return float(value)


def _rollout(raw: Any, load_time_s: float) -> RolloutSettings:
    """The `rollout:` section as the operator's RolloutSettings (load time from the top level)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"rollout must be a mapping of {', '.join(_ROLLOUT_KEYS)}, got {raw!r}")
    unknown = set(raw) - set(_ROLLOUT_KEYS)
    if unknown:
        raise ValueError(
            f"unknown rollout keys: {sorted(unknown)} (known: {', '.join(_ROLLOUT_KEYS)}; "
            "load_time_s is a top-level key)"
        )
    d = RolloutSettings()
    surge = raw.get("max_surge", d.max_surge)
    if isinstance(surge, bool) or not isinstance(surge, int) or surge < 0:
        raise ValueError(f"rollout.max_surge must be a whole number of pods >= 0, got {surge!r}")
    canary = raw.get("canary", d.canary)
    if not isinstance(canary, bool):
        raise ValueError(f"rollout.canary must be true or false, got {canary!r}")
    return RolloutSettings(
        max_surge=surge,
        canary=canary,
        shutdown_timeout_s=_number(
            "rollout", "shutdown_timeout_s", raw.get("shutdown_timeout_s", d.shutdown_timeout_s)
        ),
        pre_stop_s=_number("rollout", "pre_stop_s", raw.get("pre_stop_s", d.pre_stop_s)),
        load_time_s=load_time_s,
    )


def _autoscaler(raw: Any) -> AutoscalerSpec | None:
    return None if raw is None else AutoscalerSpec.parse(raw)


def _scale_rate(rate: Any, k: float) -> Any:
    """A vllm_sim rate spec multiplied by `k` (per-replica rate -> deployment rate)."""
    if isinstance(rate, int | float):
        return float(rate) * k
    ((kind, value),) = dict(rate).items()
    if kind == "constant":
        return {"constant": float(value) * k}
    if kind == "steps":
        return {"steps": [[float(t), float(r) * k] for t, r in value]}
    if kind == "ramp":
        return {"ramp": {"from": float(value["from"]) * k, "to": float(value["to"]) * k}}
    if kind == "diurnal":
        return {"diurnal": {**dict(value), "mean": float(value["mean"]) * k}}
    raise ValueError(f"unknown rate profile {kind!r}")


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    gpu: str
    tensor_parallel_size: int
    max_model_len: int | None
    replicas: int
    load_time_s: float
    horizon_s: float
    seed: int
    workload: Mapping[str, Any]
    slo: SLO
    bounds: Bounds
    policy_raw: Mapping[str, float]
    reality: Reality
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    truth_requests: int = 1000
    truth_seed: int = 11
    description: str = ""
    key: str = ""
    raw: Mapping[str, Any] = field(default_factory=dict)
    autoscaler: AutoscalerSpec | None = None

    def truth_key(self) -> str:
        """Hash of what ground truth depends on (not traffic level, horizon, policy, replicas):
        retuning a scenario's traffic keeps its cached oracle."""
        shape = {k: v for k, v in self.workload.items() if k not in ("rate", "burstiness")}
        fields = {
            k: self.raw.get(k)
            for k in ("model", "gpu", "tensor_parallel_size", "max_model_len", "slo", "reality",
                      "truth", "bounds")
        }  # fmt: skip
        # The simulator's physics is part of the truth: a refit of its step-time constants
        # must not reuse an oracle computed with the old ones.
        physics = dataclasses.asdict(steptime.CALIBRATION)
        key: dict[str, Any] = {"shape": shape, **fields, "physics": physics,
                               "measure": TRUTH_MEASURE}  # fmt: skip
        if self.pod_burstiness() != 1.0:  # Poisson scenarios keep their cached truth
            key["pod_burstiness"] = round(self.pod_burstiness(), 6)
        text = json.dumps(key, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def deployment_workload(self, horizon_s: float | None = None) -> WorkloadSpec:
        """The live traffic of the whole deployment over the horizon."""
        d = dict(self.workload)
        d["rate"] = _scale_rate(d.get("rate", 1.0), self.replicas)
        d["duration"] = float(horizon_s if horizon_s is not None else self.horizon_s)
        d["seed"] = self.seed
        d.setdefault("name", self.name)
        return WorkloadSpec.from_dict(d)

    def pod_burstiness(self) -> float:
        """The gamma shape of one pod's arrivals (1: Poisson). The Service spreads requests
        over the `replicas` pods at random, and thinning a renewal process with gap cv2
        `c` to a share p leaves counts whose variance over mean is p c + 1 - p: 0.3 over two
        pods (c = 3.33) gives 2.17, shape 0.46."""
        b = float(self.workload.get("burstiness", 1.0))
        p = 1.0 / max(1, self.replicas)
        return 1.0 / (p / b + 1.0 - p)

    def shape(self, rate_per_replica: float, requests: int, seed: int) -> WorkloadSpec:
        """The scenario's request shape at a constant rate per replica, with one pod's
        burstiness (`pod_burstiness`): what ground truth and benchmarks measure capacity on."""
        d = {k: v for k, v in self.workload.items() if k not in ("rate", "burstiness")}
        d["burstiness"] = self.pod_burstiness()
        d["rate"] = float(rate_per_replica)
        d["duration"] = requests / max(rate_per_replica, 1e-9)
        d["max_requests"] = requests
        d["seed"] = seed
        d["name"] = f"{self.name}-bench"
        return WorkloadSpec.from_dict(d)

    def peak_rate_per_replica(self) -> float:
        spec = WorkloadSpec.from_dict({**self.workload, "duration": self.horizon_s})
        import numpy as np

        grid = np.linspace(0.0, self.horizon_s, 2001)
        return float(np.max(spec.rate.rate_at(grid)))

    def policy(self, mode: str = "Auto") -> TuningPolicy:
        p = {**_POLICY_DEFAULTS, **self.policy_raw}
        return TuningPolicy(
            slo=self.slo,
            bounds=self.bounds,
            rollout=RolloutRules(
                min_interval_s=float(p["min_interval_s"]),
                max_per_day=int(p["max_per_day"]),
                verify_window_s=float(p["verify_window_s"]),
                ready_timeout_s=float(p["ready_timeout_s"]),
            ),
            min_requests_per_window=int(p["min_requests_per_window"]),
            evaluation_window_s=float(p["evaluation_window_s"]),
            mode=mode,  # type: ignore[arg-type]
            safety_margin=float(p["safety_margin"]),
            min_gain_pct=float(p["min_gain_pct"]),
            gmu_rise_step=float(p["gmu_rise_step"]),
        )


def parse(raw: Mapping[str, Any], key: str = "") -> Scenario:
    unknown = set(raw) - _KNOWN
    if unknown:
        raise ValueError(f"unknown scenario keys: {sorted(unknown)}")
    for required in ("name", "model", "workload"):
        if required not in raw:
            raise ValueError(f"scenario needs {required!r}")
    slo_raw = raw.get("slo") or {}
    slo = SLO(
        ttft=_target(slo_raw.get("ttft")),
        itl=_target(slo_raw.get("itl")),
        e2e=_target(slo_raw.get("e2e")),
    )
    if not slo.targets():
        raise ValueError("scenario needs at least one SLO target")
    workload = dict(raw["workload"])
    WorkloadSpec.from_dict({**workload, "duration": 1.0})  # validate early
    truth = raw.get("truth") or {}
    if not key:
        key = hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]
    mml = raw.get("max_model_len")
    load_time_s = _number("scenario", "load_time_s", raw.get("load_time_s", 120.0))
    replicas = raw.get("replicas", 2)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a whole number >= 1, got {replicas!r}")
    return Scenario(
        name=str(raw["name"]),
        description=str(raw.get("description", "")),
        model=str(raw["model"]),
        gpu=str(raw.get("gpu", "H100")),
        tensor_parallel_size=int(raw.get("tensor_parallel_size", 1)),
        max_model_len=None if mml is None else int(mml),
        replicas=replicas,
        load_time_s=load_time_s,
        horizon_s=float(raw.get("horizon_s", 10800.0)),
        seed=int(raw.get("seed", 1)),
        workload=workload,
        slo=slo,
        bounds=_bounds(raw.get("bounds") or {}),
        policy_raw={k: float(v) for k, v in (raw.get("policy") or {}).items()},
        reality=Reality(**(raw.get("reality") or {})),
        rollout=_rollout(raw.get("rollout"), load_time_s),
        truth_requests=int(truth.get("requests", 1000)),
        truth_seed=int(truth.get("seed", 11)),
        key=key,
        raw=dict(raw),
        autoscaler=_autoscaler(raw.get("autoscaler")),
    )


def load(path: str | Path) -> Scenario:
    text = Path(path).read_text(encoding="utf-8")
    raw = yaml.safe_load(text)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a scenario is a YAML mapping")
    return parse(raw, hashlib.sha256(text.encode()).hexdigest()[:16])
