"""The Deployment controller's arithmetic, kept free of I/O so it reads like the rules it follows.

Facts from the Kubernetes Deployment documentation and controller (pkg/controller/deployment):
the pod-template-hash label names a revision; maxSurge rounds up and maxUnavailable rounds down
when given as a percentage, and both zero is made maxUnavailable 1; a rollout makes progress
while new pods become available and fails after progressDeadlineSeconds (default 600) without.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TEMPLATE_HASH_LABEL = "pod-template-hash"
REVISION_ANNOTATION = "deployment.kubernetes.io/revision"
DEFAULT_PROGRESS_DEADLINE_S = 600
# Name suffix characters of generated names (k8s.io/apimachinery util/rand: no vowels, no 0/1/3,
# so a name never spells a word).
SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def template_hash(template: Mapping[str, Any]) -> str:
    """A stable name for a pod template: equal templates give equal hashes across restarts."""
    canonical = json.dumps(template, sort_keys=True, separators=(",", ":"))
    digest = int.from_bytes(hashlib.sha256(canonical.encode()).digest()[:8], "big")
    chars = []
    for _ in range(10):
        digest, index = divmod(digest, len(SUFFIX_ALPHABET))
        chars.append(SUFFIX_ALPHABET[index])
    return "".join(chars)


def random_suffix(length: int = 5) -> str:
    return "".join(random.choice(SUFFIX_ALPHABET) for _ in range(length))


def int_or_percent(value: Any, total: int, *, round_up: bool) -> int:
    if value is None:
        return 0
    if isinstance(value, str) and value.endswith("%"):
        fraction = float(value[:-1]) / 100.0 * total
        return math.ceil(fraction) if round_up else math.floor(fraction)
    return int(value)


@dataclass(frozen=True)
class Strategy:
    recreate: bool
    max_surge: int
    max_unavailable: int


def strategy_of(spec: Mapping[str, Any], replicas: int) -> Strategy:
    """The effective strategy; absent fields take the API defaults (25%/25%), except that this
    runner's documented default for GPU nodes is surge-free when rollingUpdate is absent."""
    strategy = spec.get("strategy") or {}
    if strategy.get("type") == "Recreate":
        return Strategy(recreate=True, max_surge=0, max_unavailable=replicas)
    rolling = strategy.get("rollingUpdate")
    if rolling is None:
        return Strategy(recreate=False, max_surge=0, max_unavailable=1)
    surge = int_or_percent(rolling.get("maxSurge", "25%"), replicas, round_up=True)
    unavailable = int_or_percent(rolling.get("maxUnavailable", "25%"), replicas, round_up=False)
    if surge == 0 and unavailable == 0:
        unavailable = 1
    return Strategy(recreate=False, max_surge=surge, max_unavailable=unavailable)


@dataclass(frozen=True)
class RevisionCounts:
    """One ReplicaSet as the rolling update sees it."""

    name: str
    desired: int  # spec.replicas
    pods: int  # live pods
    available: int  # ready pods


def rolling_targets(
    replicas: int, strategy: Strategy, new: RevisionCounts, old: list[RevisionCounts]
) -> tuple[int, dict[str, int]]:
    """Next desired replica counts (new, {old name: count}) for one step of a rolling update.

    Scale-up of the new revision is bounded by replicas + maxSurge pods in total; scale-down of
    old revisions by replicas - maxUnavailable available pods, unavailable old pods going first.
    """
    old_targets = {rs.name: rs.desired for rs in old}
    if strategy.recreate:
        if any(rs.pods or rs.desired for rs in old):
            return 0, dict.fromkeys(old_targets, 0)
        return replicas, old_targets
    total = new.desired + sum(rs.desired for rs in old)
    new_target = new.desired
    allowed = replicas + strategy.max_surge
    if new.desired > replicas:
        new_target = replicas
    elif total < allowed and new.desired < replicas:
        new_target = min(replicas, new.desired + allowed - total)
    min_available = replicas - strategy.max_unavailable
    new_unavailable = max(new_target - new.available, 0)
    budget = total - min_available - new_unavailable
    if budget <= 0:
        return new_target, old_targets
    # Old pods that are not available cost no availability: remove them first.
    for rs in old:
        if budget <= 0:
            break
        unhealthy = max(old_targets[rs.name] - rs.available, 0)
        cut = min(unhealthy, budget)
        old_targets[rs.name] -= cut
        budget -= cut
    available = new.available + sum(min(rs.available, old_targets[rs.name]) for rs in old)
    budget = min(budget, available - min_available)
    for rs in old:
        if budget <= 0:
            break
        cut = min(old_targets[rs.name], budget)
        old_targets[rs.name] -= cut
        budget -= cut
    return new_target, old_targets


def condition(
    kind: str, status: bool, reason: str, message: str, now: str, previous: Mapping[str, Any] | None
) -> dict[str, Any]:
    """A condition whose lastTransitionTime only moves when the status flips."""
    text = "True" if status else "False"
    transition = now
    if previous is not None and previous.get("status") == text:
        transition = str(previous.get("lastTransitionTime") or now)
    return {"type": kind, "status": text, "reason": reason, "message": message,
            "lastTransitionTime": transition}  # fmt: skip
