"""The Kubernetes API misbehaves: conflicts, server errors, timeouts, 410 Gone, hand edits.

Each test injects the fault through a proxy in front of the real API server while the real
operator runs, then checks that the operator converges to the desired state without writing
anything half-done.
"""

from __future__ import annotations

import time
from typing import Any

from tests.support.cluster_api import (
    CR_PATH,
    DEPLOYMENT_PATH,
    NS,
    POLICY,
    POLICY_PATH,
    Api,
    ApiServer,
    args_of,
)
from tests.support.fake_fleet import FakeKubelet, SyntheticSnapshots
from tests.support.faults import (
    START,
    compact,
    cr_with_mode,
    deployment_apply,
    deployment_versions,
    events,
    fast_policy,
    knobs_of,
    live_knobs,
    operator,
    operator_config,
    status_of,
    status_patch,
    template_history,
    trials_of,
    tuning_of,
    wait_some,
)
from tests.support.waiting import wait_for
from vllm_autotuner.core.render import KNOBS_ANNOTATION
from vllm_autotuner.core.tuning_inputs import parse_knob_label
from vllm_localcluster.faults import FaultProxy


def _converged(api: Api, generation: int) -> dict[str, Any] | None:
    """The status once it reflects `generation` with every field a reconcile writes."""
    status = status_of(api)
    fields = ("observedGeneration", "conditions", "tuning", "mode", "policy")
    if status.get("observedGeneration") != generation or not all(k in status for k in fields):
        return None
    return status


def test_conflicts_on_status_and_apply_are_retried_with_fresh_state(
    apiserver: ApiServer, proxy: FaultProxy, api: Api
) -> None:
    api.create(POLICY_PATH, POLICY)
    api.create(CR_PATH, cr_with_mode("Recommend"))
    status_conflicts = proxy.inject(status_patch, status=409, times=3)
    apply_conflicts = proxy.inject(deployment_apply, status=409, times=3)
    with operator(operator_config(proxy, interval_s=1.0)):
        started = time.monotonic()
        wait_for(lambda: live_knobs(api) == START, 20, message="the Deployment despite 409s")
        status = wait_some(lambda: _converged(api, 1), 20, "status despite 409s")
        took = time.monotonic() - started
        assert status_conflicts.hits == 3 and apply_conflicts.hits == 3
        # Retried within seconds, not after kopf's default 60 s handler backoff.
        assert took < 15, took
        assert status["tuning"]["applied"] == START.to_dict()
        assert {c["type"] for c in status["conditions"]} >= {"Ready", "PolicyResolved"}

        # The retry uses the newest spec, not the one the failed attempt saw.
        more = proxy.inject(deployment_apply, status=409, times=2)
        api.merge(f"{CR_PATH}/llama", {"spec": {"replicas": 2}})
        wait_for(
            lambda: (api.get(f"{DEPLOYMENT_PATH}/llama") or {})["spec"]["replicas"] == 2,
            20,
            message="the new spec applied after conflicts",
        )
        assert more.hits == 2
        wait_for(lambda: _converged(api, 2), 20, message="observedGeneration 2")
        assert status_of(api)["tuning"]["applied"] == START.to_dict()


def _template_consistent(obj: dict[str, Any]) -> bool:
    """The pod template's knob annotation and its vLLM args name the same knobs."""
    annotations = obj["spec"]["template"]["metadata"].get("annotations") or {}
    labelled = parse_knob_label(annotations.get(KNOBS_ANNOTATION))
    return labelled is not None and labelled == knobs_of(obj)


def test_server_errors_and_timeouts_back_off_and_never_half_apply(
    apiserver: ApiServer, proxy: FaultProxy, api: Api
) -> None:
    api.create(POLICY_PATH, fast_policy())
    api.create(CR_PATH, cr_with_mode("Auto"))
    metrics = SyntheticSnapshots()
    config = operator_config(proxy, interval_s=0.5, request_timeout_s=1.0)
    with FakeKubelet(apiserver, NS), operator(config, metrics):
        wait_for(lambda: live_knobs(api) == START, 20, message="first Deployment")
        # Every write the operator tries now fails: 500 for applies, 503 for status.
        e500 = proxy.inject(deployment_apply, status=500, times=None)
        e503 = proxy.inject(status_patch, status=503, times=None)
        started = time.monotonic()
        violations: list[dict[str, Any]] = []

        def failing_for_a_while() -> bool:
            """Check the invariant on every poll while the faults last."""
            state = tuning_of(api)
            live = live_knobs(api)
            if state.get("phase") in ("RollingOut", "Verifying") and (
                live is None or state["applied"] != live.to_dict()
            ):
                violations.append(state)
            return e500.hits >= 8

        wait_for(failing_for_a_while, 20, message="several failed applies")
        elapsed = time.monotonic() - started
        # Backed off: a reconcile every ~0.125..0.5 s plus event-driven ones, never a hot loop.
        attempts = e500.hits + e503.hits
        assert attempts <= 6 * elapsed + 6, (attempts, elapsed)
        assert not violations, violations
        # The status never claimed the rollout: no trial was recorded while writes failed.
        assert trials_of(api) == []
        assert live_knobs(api) == START
        proxy.clear_faults()

        # Timeouts: the server takes longer than the client waits (the write lands later).
        slow = proxy.inject(deployment_apply, status=None, times=2, delay=1.5)
        committed = wait_for(
            lambda: [t for t in trials_of(api) if t["outcome"] == "Committed"],
            40,
            message="a committed trial after the faults",
        )
        assert slow.hits >= 1  # the late write landed, so a retry may find nothing to do
        assert live_knobs(api) != START
        assert (live_knobs(api) or START).to_dict() == tuning_of(api)["applied"]
        assert committed[0]["knobs"] == tuning_of(api)["applied"]
    # Never a mixed template: every version the Deployment ever had is self-consistent.
    versions = deployment_versions(proxy)
    assert versions and all(_template_consistent(v) for v in versions)
    assert template_history(proxy)[0] == START


def _deployment_spec(api: Api) -> dict[str, Any]:
    return dict((api.get(f"{DEPLOYMENT_PATH}/llama") or {})["spec"])


def test_watch_expired_with_410_gone_relists_and_keeps_reconciling(
    apiserver: ApiServer, proxy: FaultProxy, api: Api
) -> None:
    api.create(POLICY_PATH, POLICY)
    api.create(CR_PATH, cr_with_mode("Recommend"))
    with operator(operator_config(proxy, interval_s=1.0)):
        wait_for(lambda: live_knobs(api) == START, 20, message="first Deployment")
        wait_for(lambda: _converged(api, 1), 20, message="first status")

        def lists() -> int:
            return len(
                proxy.requests_matching(
                    verb="list", resource="vllmdeployments", user_agent=_kopf_agents(proxy)
                )
            )

        listed = lists()
        # The watch drops and cannot reconnect for a while; meanwhile the CR changes and the
        # server compacts its event history, so kopf resumes from a resourceVersion the
        # server no longer has (410 Gone) and must relist to see the change.
        cut = proxy.inject({"verb": "watch", "resource": "vllmdeployments"}, status=503, times=None)
        proxy.close_watches()
        wait_for(lambda: cut.hits >= 1, 20, message="kopf trying to reconnect its watch")
        api.merge(f"{CR_PATH}/llama", {"spec": {"replicas": 3}})
        api.create(
            f"/api/v1/namespaces/{NS}/configmaps",
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "bump"}},
        )
        compacted_at = time.time()
        compacted = compact(proxy, api)
        proxy.clear_faults()
        wait_for(lambda: lists() > listed, 20, message="kopf relisted after 410 Gone")
        resumed = [
            int(r.params["resourceVersion"])
            for r in proxy.requests_matching(verb="watch", resource="vllmdeployments")
            if r.status_code == 200 and "resourceVersion" in r.params and r.time > compacted_at
        ]
        assert any(rv < compacted for rv in resumed), (resumed, compacted)  # it did get a 410
        wait_for(
            lambda: _deployment_spec(api)["replicas"] == 3,
            20,
            message="a change made across the 410 reached the Deployment",
        )
        # And later changes still arrive through the new watch.
        api.merge(f"{CR_PATH}/llama", {"spec": {"replicas": 1}})
        wait_for(lambda: _deployment_spec(api)["replicas"] == 1, 20, message="a later change")
        wait_for(lambda: _converged(api, 3), 20, message="observedGeneration 3")


def _kopf_agents(proxy: FaultProxy) -> set[str | None]:
    return {r.user_agent for r in proxy.requests if (r.user_agent or "").startswith("kopf")}


def test_hand_edited_or_deleted_deployment_is_restored_with_an_event(
    apiserver: ApiServer, proxy: FaultProxy, api: Api
) -> None:
    api.create(POLICY_PATH, POLICY)
    api.create(CR_PATH, cr_with_mode("Recommend"))
    with operator(operator_config(proxy, interval_s=1.0)):
        deployment = wait_some(lambda: api.get(f"{DEPLOYMENT_PATH}/llama"), 20, "Deployment")
        wait_for(lambda: _converged(api, 1), 20, message="first status")
        original = args_of(deployment)
        edited = [*original[:-1], "0.5"]
        api.merge(
            f"{DEPLOYMENT_PATH}/llama",
            {"spec": {"template": {"spec": {"containers": [{"name": "vllm", "args": edited}]}}}},
            strategic=True,
        )
        wait_for(lambda: args_of(_deployment(api)) == original, 15, message="args restored")
        (restored,) = wait_for(
            lambda: events(api, "DeploymentRestored"), 15, message="a DeploymentRestored event"
        )
        assert restored["type"] == "Warning"
        assert "containers[0].args" in restored["message"], restored["message"]

        api.delete(f"{DEPLOYMENT_PATH}/llama")
        recreated = wait_some(lambda: api.get(f"{DEPLOYMENT_PATH}/llama"), 15, "re-created")
        assert knobs_of(recreated) == START
        assert recreated["metadata"]["uid"] != deployment["metadata"]["uid"]
        wait_for(
            lambda: any("deleted" in e["message"] for e in events(api, "DeploymentRestored")),
            15,
            message="an event about the deletion",
        )
    # The operator's own creation was not reported as a restore.
    created = events(api, "DeploymentCreated")
    assert len(created) == 1 and created[0]["type"] == "Normal"


def _deployment(api: Api) -> dict[str, Any]:
    return api.get(f"{DEPLOYMENT_PATH}/llama") or {}
