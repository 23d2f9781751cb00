"""Is a rollout worth what it costs, and can the pods that stay carry the traffic meanwhile?

Pure arithmetic on the model's per-pod capacities (requests/s within the SLO):

- **Cost** of a trial: the serving capacity lost while restarted pods load, times the current
  load: every pod restart that takes a serving pod away costs `load_time_s` of that pod's
  traffic. A canary trial restarts one pod for the canary and every pod on promotion; with
  surge, new pods come up beside the old ones and nothing is lost.
- **Gain**: the requests the new knobs serve within the SLO that the old ones would not, over
  the time the new knobs will be kept, at the load that matters: the current one, or the
  highest seen lately when that is higher (a change must hold at the peak, not only at today's
  trough).
- **Gain beside a replica autoscaler** (`ctx.autoscaled`): the autoscaler keeps each pod below
  its capacity, so more capacity serves no more requests; it frees replicas. At load L, a
  replica count that follows L ÷ capacity drops by the share 1 - capacity_now ÷ capacity_new,
  so the gain is that share of the requests over the keep time (the GPU time that served them,
  counted in requests as the cost is).
- **Headroom**: without surge, a restart takes one ready pod out; the others must carry its
  traffic within the SLO for the load time. Without it, the restart's cost adds the overload
  it causes (`restart_overload_rps`): the traffic above what the deployment carries while a
  pod is out, less the excess that all pods leave anyway (a deployment already past its
  capacity loses only the pod's capacity).
- **How long to wait for headroom** (`headroom_wait_s`) is ski rental: every second waited
  loses the gain rate (gain ÷ keep time); going now costs the overload on top of the plain
  restart. Waiting until the gain lost equals that extra cost, then going, never costs more
  than twice the best choice in hindsight (whenever headroom comes, or never).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_autotuner.core.tuning_types import DeploymentContext, RolloutRules, Strategy

DAY_S = 86_400.0


@dataclass(frozen=True)
class Worth:
    worth: bool
    gain_requests: float
    cost_requests: float
    keep_s: float
    text: str
    # The restart now, with the overload it causes the pods that stay (= cost_requests with
    # headroom or surge).
    cost_now_requests: float

    @property
    def gain_rate(self) -> float:
        """Requests per second the new knobs win: what each second of waiting loses."""
        return self.gain_requests / self.keep_s if self.keep_s > 0 else 0.0


def keep_time_s(rules: RolloutRules) -> float:
    """How long new knobs are expected to stay: the rollout budget's spacing (a day over the
    daily budget), at least the minimum interval between rollouts."""
    return max(rules.min_interval_s, DAY_S / max(1, rules.max_per_day))


def restarts(ctx: DeploymentContext, strategy: Strategy) -> int:
    """Pod restarts of a trial that is promoted (a canary adds one)."""
    return max(1, ctx.replicas) + (1 if strategy == "Canary" else 0)


# A request that arrives while the pods that stay are past their capacity waits in a queue
# that outlives the restart; it and the requests queued behind it miss the SLO. Counted as
# this many missed requests per request over capacity: bench/tuning's chat-8b-h100 without
# surge lost about 3.6 good requests per request over capacity during its restarts.
OVERLOAD_HARM = 4.0


def cost_requests(
    ctx: DeploymentContext, strategy: Strategy, rate_per_pod: float, excess_rps: float = 0.0
) -> float:
    """The capacity a trial takes away while restarted pods load, in requests, plus the
    requests an overload of the pods that stay makes miss the SLO (`excess_rps`: the traffic
    above what they can carry that the restart causes, whole deployment;
    `restart_overload_rps`)."""
    if ctx.rollout.max_surge > 0:
        return 0.0
    n = restarts(ctx, strategy) * ctx.rollout.load_time_s
    return n * (max(0.0, rate_per_pod) + OVERLOAD_HARM * max(0.0, excess_rps))


def restart_overload_rps(
    ctx: DeploymentContext, capacity_per_pod: float, rate_per_pod: float
) -> float:
    """The traffic above what the deployment carries within the SLO that one restart causes:
    the excess while a pod is out, less the excess with every pod in (that one is there
    without the restart). Zero with surge or headroom; at most one pod's capacity, reached
    when the deployment is already past its capacity."""
    if ctx.rollout.max_surge > 0:
        return 0.0
    n = max(1, ctx.replicas)
    load = max(0.0, rate_per_pod) * n
    capacity = max(0.0, capacity_per_pod)
    while_out = max(0.0, load - capacity * (n - 1))
    # = while_out - max(0, load - capacity x n), written so that it is exact in floating point
    return min(capacity, while_out)


def headroom_wait_s(cost_now: float, cost_room: float, gain_rate: float, limit_s: float) -> float:
    """How long to wait for headroom before going without it (ski rental): until the gain lost
    by waiting (`gain_rate` requests per second) equals the extra cost of going now
    (`cost_now - cost_room`), at most `limit_s`. Whenever headroom comes, or never, this
    costs at most twice what the best choice in hindsight costs."""
    extra = cost_now - cost_room
    limit = max(0.0, limit_s)
    if extra <= 0:
        return 0.0
    if gain_rate <= 0:
        return limit
    return min(limit, extra / gain_rate)


def gain_requests(
    capacity_now: float,
    capacity_new: float,
    rate_per_pod: float,
    replicas: int,
    keep_s: float,
) -> float:
    """Requests served within the SLO over `keep_s` that the current knobs would miss."""
    per_pod = max(0.0, min(rate_per_pod, capacity_new) - min(rate_per_pod, capacity_now))
    return per_pod * max(1, replicas) * keep_s


def worth_restart(
    ctx: DeploymentContext,
    rules: RolloutRules,
    strategy: Strategy,
    capacity_now: float,
    capacity_new: float,
    rate_now: float,
    rate_ref: float,
    miss_share: float = 0.0,
) -> Worth:
    """`miss_share`: the share of requests the window confirms over an SLO threshold now (0
    when the SLO is met). A measured violation is a gain to win whatever the model thinks the
    current knobs can do: the requests missing the SLO now, if the candidate fixes them.
    Worth it when the gain exceeds the plain restart's cost; `cost_now_requests` adds the
    overload a restart now causes (without headroom)."""
    keep = keep_time_s(rules)
    gain = gain_requests(capacity_now, capacity_new, rate_ref, ctx.replicas, keep)
    if miss_share > 0 and capacity_new >= rate_now:
        gain = max(gain, rate_now * miss_share * max(1, ctx.replicas) * keep)
    if ctx.autoscaled:
        gain = max(gain, replicas_freed_requests(capacity_now, capacity_new, rate_now, ctx, keep))
    cost = cost_requests(ctx, strategy, rate_now)
    overload = restart_overload_rps(ctx, capacity_now, rate_now)
    cost_now = cost_requests(ctx, strategy, rate_now, overload)
    n = restarts(ctx, strategy)
    how = (
        "with surge, no capacity lost"
        if ctx.rollout.max_surge > 0
        else (f"{n} pod restarts x {ctx.rollout.load_time_s:.0f} s x {rate_now:.2f} req/s")
    )
    text = (
        f"expected gain {gain:,.0f} requests within the SLO over {keep / 3600:.1f} h at "
        f"{rate_ref:.2f} req/s/pod (capacity {capacity_now:.2f} -> {capacity_new:.2f} "
        f"req/s/pod) vs restart cost {cost:,.0f} requests ({how})"
    )
    if ctx.autoscaled and capacity_new > capacity_now > 0:
        saved = 100.0 * (1.0 - capacity_now / capacity_new)
        text += f"; beside the replica autoscaler, {saved:.0f}% fewer replicas at the same load"
    if cost_now > cost:
        text += (
            f"; {cost_now:,.0f} requests without headroom ({overload:.2f} req/s over what "
            f"the pods carry x {OVERLOAD_HARM:.0f} per restart)"
        )
    return Worth(gain > cost and gain > 0, gain, cost, keep, text, cost_now)


def replicas_freed_requests(
    capacity_now: float,
    capacity_new: float,
    rate_per_pod: float,
    ctx: DeploymentContext,
    keep_s: float,
) -> float:
    """Beside a replica autoscaler: the requests over `keep_s` whose GPU time the new knobs
    free (the replicas the autoscaler gives back), the load times the share saved."""
    if capacity_new <= capacity_now or capacity_new <= 0 or capacity_now <= 0:
        return 0.0
    load = max(0.0, rate_per_pod) * max(1, ctx.replicas)
    return load * keep_s * (1.0 - capacity_now / capacity_new)


@dataclass(frozen=True)
class Headroom:
    ok: bool
    carry_rps: float  # what the pods that stay can serve within the SLO
    load_rps: float  # the whole deployment's traffic now
    text: str


def headroom(ctx: DeploymentContext, capacity_per_pod: float, rate_per_pod: float) -> Headroom:
    n = max(1, ctx.replicas)
    load = rate_per_pod * n
    if ctx.rollout.max_surge > 0:
        return Headroom(True, capacity_per_pod * n, load, "surge: no pod is taken out")
    staying = n - 1
    carry = capacity_per_pod * staying
    ok = carry >= load
    text = (
        f"{staying} pod{'s' if staying != 1 else ''} that stay can serve {carry:.2f} req/s "
        f"within the SLO, traffic is {load:.2f} req/s"
    )
    return Headroom(ok, carry, load, text)
