"""What Deployments a VLLMDeployment's tuning state calls for: the stable one and a canary.

Pure. The controller renders these (one Deployment named after the VLLMDeployment, and
`<name>-canary` while a canary runs) and the benchmark's world runs them, so both read the
state the same way:

- no trial, or a rolling trial: one Deployment of `replicas` pods on `state.applied`;
- a canary trial (RollingOut or Verifying): the stable Deployment keeps the baseline knobs on
  `replicas - 1` pods (all `replicas` when the rollout may surge, so no capacity is lost) and
  the canary Deployment runs the candidate on one pod; the Service spreads traffic over both;
- Promoting: the canary is gone and the stable Deployment rolls to the candidate on every pod.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_autotuner.core.tuning_types import DeploymentContext, Knobs, TuningState

CANARY_PHASES = ("RollingOut", "Verifying")


@dataclass(frozen=True)
class Topology:
    stable: Knobs
    stable_replicas: int
    canary: Knobs | None = None
    # Pods a rolling update may add above the replica count (the Deployment's maxSurge).
    max_surge: int = 0

    @property
    def canary_replicas(self) -> int:
        return 0 if self.canary is None else 1

    @property
    def pods(self) -> int:
        return self.stable_replicas + self.canary_replicas


def canary_running(state: TuningState) -> bool:
    return (
        state.strategy == "Canary" and state.candidate is not None and state.phase in CANARY_PHASES
    )


def topology(state: TuningState, ctx: DeploymentContext) -> Topology:
    surge = max(0, ctx.rollout.max_surge)
    replicas = max(0, ctx.replicas)
    if canary_running(state) and replicas > 0:  # scaled to zero: no GPU, no canary either
        stable = replicas if surge > 0 else replicas - 1
        return Topology(state.applied, stable, state.candidate, surge)
    return Topology(state.applied, replicas, None, surge)
