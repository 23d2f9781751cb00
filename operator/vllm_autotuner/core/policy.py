"""Resolve the policy that governs one VLLMDeployment.

The platform team's VLLMTuningPolicy sets the outer limits; the app team's VLLMDeployment may
only tighten them (a stricter SLO, a lower mode). Anything looser is refused with a reason a
person can act on, and nothing is deployed or tuned under a policy that does not apply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from vllm_autotuner.api.deployment import VLLMDeploymentSpec
from vllm_autotuner.api.policy import VLLMTuningPolicySpec

Mode = Literal["Off", "Recommend", "Auto"]
MODE_ORDER: tuple[Mode, ...] = ("Off", "Recommend", "Auto")


@dataclass(frozen=True)
class Target:
    """One latency objective: `percentile` of requests within `threshold_ms`."""

    percentile: float
    threshold_ms: float

    def describe(self) -> str:
        return f"p{self.percentile:g} <= {self.threshold_ms:g} ms"


@dataclass(frozen=True)
class EffectiveSLO:
    ttft: Target
    itl: Target
    e2e: Target | None


@dataclass(frozen=True)
class Resolution:
    """The outcome of policy resolution: either a usable policy or why there is none."""

    ok: bool
    reason: str  # CamelCase, for the PolicyResolved condition
    message: str
    mode: Mode = "Off"
    slo: EffectiveSLO | None = None
    policy_name: str | None = None


class PolicyProblem(ValueError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def _target(raw: Any) -> Target | None:
    if raw is None:
        return None
    return Target(percentile=float(raw.percentile), threshold_ms=float(raw.threshold_ms))


def _override(base: Target | None, raw: Any) -> Target | None:
    """An override may give a percentile or a threshold alone; the policy supplies the rest."""
    if raw is None:
        return None
    percentile = (
        raw.percentile if raw.percentile is not None else (base.percentile if base else 95.0)
    )
    threshold = (
        raw.threshold_ms if raw.threshold_ms is not None else (base.threshold_ms if base else None)
    )
    if threshold is None:
        raise PolicyProblem(
            "PolicyInvalid", "an SLO override without a threshold needs one in the policy"
        )
    return Target(percentile=float(percentile), threshold_ms=float(threshold))


def tighten(name: str, policy: Target | None, override: Target | None) -> Target | None:
    """The override wins only when it is at least as strict on both axes.

    A higher percentile under a lower threshold is stricter: p99 <= 40 ms implies p95 <= 50 ms.
    Anything else would let an app team loosen what the platform team promised.
    """
    if override is None:
        return policy
    if policy is None:
        return override
    if override.percentile < policy.percentile or override.threshold_ms > policy.threshold_ms:
        raise PolicyProblem(
            "SLOLooserThanPolicy",
            f"spec.tuning.slo.{name} ({override.describe()}) is looser than the policy's "
            f"({policy.describe()}); a VLLMDeployment may only tighten its policy",
        )
    return override


def cap_mode(requested: Mode, allowed: Sequence[str]) -> Mode:
    """The strongest allowed mode that is not stronger than the requested one."""
    candidates = [m for m in MODE_ORDER[: MODE_ORDER.index(requested) + 1] if m in allowed]
    return candidates[-1] if candidates else "Off"


def _match_expression(labels: Mapping[str, str], expr: Any) -> bool:
    key = expr.key
    op = expr.operator
    values = list(expr.values or [])
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    raise PolicyProblem("PolicyInvalid", f"unknown label selector operator {op!r}")


def namespace_selected(selector: Any, namespace_labels: Mapping[str, str]) -> bool:
    """Kubernetes LabelSelector semantics; an absent or empty selector selects everything."""
    if selector is None:
        return True
    for key, value in dict(selector.match_labels or {}).items():
        if namespace_labels.get(key) != value:
            return False
    return all(_match_expression(namespace_labels, e) for e in selector.match_expressions or [])


def is_catch_all(selector: Any) -> bool:
    """A selector with no terms selects every namespace: the platform's default policy."""
    return selector is None or not (selector.match_labels or selector.match_expressions)


def governing_policies(
    selectors: Mapping[str, Any], namespace_labels: Mapping[str, str]
) -> tuple[str, ...]:
    """The policies a namespace must choose from (who chooses the policy: docs/decisions.md).

    A policy whose namespaceSelector names the namespace (a non-empty selector that matches)
    was put there by the platform team for it, and binds it: a catch-all policy is then not
    a choice. Only a namespace that no targeted policy selects may use catch-all policies.
    `selectors` maps each policy's name to its parsed namespaceSelector.
    """
    targeted = sorted(
        name
        for name, selector in selectors.items()
        if not is_catch_all(selector) and namespace_selected(selector, namespace_labels)
    )
    if targeted:
        return tuple(targeted)
    return tuple(sorted(name for name, sel in selectors.items() if is_catch_all(sel)))


def resolve(
    spec: VLLMDeploymentSpec,
    policy_name: str,
    policy: VLLMTuningPolicySpec | None,
    namespace: str,
    namespace_labels: Mapping[str, str],
    governing: Sequence[str] | None = None,
) -> Resolution:
    """The policy in force for one deployment, in every mode (Off included): the platform
    team's bounds and namespace selection bind whatever the tenant asks for.

    `governing` is what `governing_policies` says this namespace may choose from; None skips
    that check (callers that see only one policy).
    """
    requested: Mode = spec.tuning.mode
    if policy is None:
        return Resolution(
            ok=False,
            reason="PolicyNotFound",
            message=f"VLLMTuningPolicy {policy_name!r} does not exist; nothing is deployed "
            "without a policy, in any mode (create it or set spec.tuning.policyRef)",
        )
    try:
        if not namespace_selected(policy.namespace_selector, namespace_labels):
            raise PolicyProblem(
                "NamespaceNotSelected",
                f"VLLMTuningPolicy {policy_name!r} does not select namespace {namespace!r} "
                "(its namespaceSelector does not match the namespace's labels)",
            )
        if governing is not None and policy_name not in governing:
            allowed = ", ".join(governing) or "none"
            raise PolicyProblem(
                "PolicyNotAllowed",
                f"namespace {namespace!r} is governed by VLLMTuningPolicy {allowed}; "
                f"spec.tuning.policyRef {policy_name!r} is not one of them",
            )
        override = spec.tuning.slo
        targets = {}
        for key in ("ttft", "itl", "e2e"):
            base = _target(getattr(policy.slo, key, None))
            wanted = _override(base, getattr(override, key, None) if override else None)
            targets[key] = tighten(key, base, wanted)
        ttft, itl, e2e = targets["ttft"], targets["itl"], targets["e2e"]
    except PolicyProblem as problem:
        return Resolution(ok=False, reason=problem.reason, message=problem.message)
    assert ttft is not None and itl is not None
    mode = cap_mode(requested, list(policy.allowed_modes))
    message = f"policy {policy_name!r}: TTFT {ttft.describe()}, ITL {itl.describe()}"
    if mode != requested:
        message += f"; mode {requested} is not allowed by the policy, running in {mode}"
    return Resolution(
        ok=True,
        reason="Resolved" if mode == requested else "ModeCapped",
        message=message,
        mode=mode,
        slo=EffectiveSLO(ttft=ttft, itl=itl, e2e=e2e),
        policy_name=policy_name,
    )
