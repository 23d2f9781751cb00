"""Class 3: who chooses the policy. The platform team's bounds and namespace selection bind in
every mode; a tenant never picks its own limits (docs/decisions.md, docs/policies.md).

- A deployment needs an existing policy in every mode, Off included: no policy, nothing deployed.
- A policy whose namespaceSelector names a namespace (non-empty and matching) governs it: that
  namespace may name only such policies, never a catch-all one (empty selector).
- A namespace no targeted policy selects may name any catch-all policy.
- Whatever runs, in any mode, is inside the governing policy's bounds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.unit.security.corpus import POLICY
from tests.unit.security.hostile_objects import conditions, deployment, reconcile

HUGE_KNOBS = {"maxNumBatchedTokens": 1_048_576, "maxNumSeqs": 1024, "gpuMemoryUtilization": 0.99}


def _policy(selector: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    out = copy.deepcopy(POLICY["spec"])
    if selector is not None:
        out["namespaceSelector"] = selector
    out.update(spec)
    return out


STRICT_BOUNDS = {
    "maxNumBatchedTokens": {"min": 256, "max": 4096},
    "gpuMemoryUtilization": {"min": 0.5, "max": 0.8},
}
LOOSE_BOUNDS = {
    "maxNumBatchedTokens": {"min": 1, "max": 1_048_576},
    "maxNumSeqs": {"min": 1, "max": 1024},
    "gpuMemoryUtilization": {"min": 0.5, "max": 0.99},
}
POLICIES = {
    "default": _policy(),
    "loose": _policy(bounds=LOOSE_BOUNDS),
    "strict-a": _policy({"matchLabels": {"team": "a"}}, bounds=STRICT_BOUNDS),
    "strict-a-expr": _policy(
        {"matchExpressions": [{"key": "team", "operator": "In", "values": ["a", "a2"]}]},
        bounds=STRICT_BOUNDS,
    ),
    "team-b": _policy({"matchLabels": {"team": "b"}}),
}
TEAM_A = {"team": "a"}


@dataclass(frozen=True)
class Choice:
    id: str
    mode: str
    ref: str
    reason: str  # PolicyResolved's reason
    labels: dict[str, str] = field(default_factory=lambda: dict(TEAM_A))
    policies: dict[str, dict[str, Any]] = field(default_factory=lambda: POLICIES)


REFUSED = [
    # no policy at all: nothing is deployed, whatever the mode
    Choice("off-missing-policy", "Off", "gone", "PolicyNotFound", {}),
    Choice("off-missing-policy-in-selected-ns", "Off", "gone", "PolicyNotFound"),
    Choice("off-missing-default", "Off", "default", "PolicyNotFound", {}, {}),
    Choice("recommend-missing-policy", "Recommend", "gone", "PolicyNotFound", {}),
    Choice("auto-missing-policy", "Auto", "gone", "PolicyNotFound", {}),
    # a namespace a targeted policy governs may not name a catch-all one
    Choice("off-names-loose", "Off", "loose", "PolicyNotAllowed"),
    Choice("recommend-names-loose", "Recommend", "loose", "PolicyNotAllowed"),
    Choice("auto-names-loose", "Auto", "loose", "PolicyNotAllowed"),
    Choice("auto-names-default", "Auto", "default", "PolicyNotAllowed"),
    Choice("off-names-default", "Off", "default", "PolicyNotAllowed"),
    Choice("expr-governed-names-loose", "Auto", "loose", "PolicyNotAllowed", {"team": "a2"}),
    Choice(
        "governing-policy-invalid-names-loose",
        "Off",
        "loose",
        "PolicyNotAllowed",
        policies={
            **POLICIES,
            "strict-a": {**POLICIES["strict-a"], "evaluationWindow": "not-a-duration"},
        },
    ),
    # a policy that does not select the namespace is never usable
    Choice("off-names-other-teams-policy", "Off", "team-b", "NamespaceNotSelected"),
    Choice("auto-names-other-teams-policy", "Auto", "team-b", "NamespaceNotSelected"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c.id for c in REFUSED])
def test_a_tenant_cannot_escape_the_policy_that_governs_it(case: Choice) -> None:
    obj = deployment(
        ("spec.tuning", {"mode": case.mode, "policyRef": case.ref}),
        ("spec.knobs", HUGE_KNOBS),
    )
    kube, outcome = reconcile(obj, policies=case.policies, namespace_labels=case.labels)
    assert kube.applied == [], "deployed without the governing policy"
    resolved = conditions(kube)["PolicyResolved"]
    assert (resolved["status"], resolved["reason"]) == ("False", case.reason)
    assert any(e.reason == case.reason and e.type == "Warning" for e in outcome.events)


def test_a_deployment_whose_policy_was_deleted_keeps_its_pods_and_is_not_changed() -> None:
    """Nothing is deleted or re-applied: the existing Deployment stays as it was."""
    obj = deployment(("spec.tuning", {"mode": "Off", "policyRef": "gone"}))
    live = {"metadata": {"name": "llama"}, "spec": {"replicas": 1}}
    kube, _ = reconcile(obj, policies={}, children={"Deployment": live, "Service": None})
    assert kube.applied == []
    assert conditions(kube)["Degraded"]["reason"] == "PolicyNotFound"


def _args(kube: Any) -> list[str]:
    manifest = next(m for m in kube.applied if m["kind"] == "Deployment")
    return list(manifest["spec"]["template"]["spec"]["containers"][0]["args"])


@pytest.mark.parametrize("mode", ["Off", "Recommend", "Auto"])
@pytest.mark.parametrize("ref", ["strict-a", "strict-a-expr"])
def test_what_runs_is_inside_the_governing_policys_bounds_in_every_mode(
    mode: str, ref: str
) -> None:
    obj = deployment(("spec.tuning", {"mode": mode, "policyRef": ref}), ("spec.knobs", HUGE_KNOBS))
    kube, outcome = reconcile(obj, policies=POLICIES, namespace_labels=TEAM_A)
    args = _args(kube)
    assert int(args[args.index("--max-num-batched-tokens") + 1]) <= 4096
    assert float(args[args.index("--gpu-memory-utilization") + 1]) <= 0.8
    assert any(e.reason == "KnobsClamped" for e in outcome.events)


def test_a_namespace_no_targeted_policy_selects_may_use_a_catch_all() -> None:
    obj = deployment(("spec.tuning", {"mode": "Off", "policyRef": "loose"}))
    kube, _ = reconcile(obj, policies=POLICIES, namespace_labels={"team": "c"})
    assert [m["kind"] for m in kube.applied] == ["Deployment", "Service"]
    assert conditions(kube)["PolicyResolved"]["status"] == "True"
