"""The closed loop beside a replica autoscaler (docs/autoscaling.md): the real operator tunes
while another field manager moves the replica count every two minutes through the scale
subresource, as the HPA controller writes it (vllm_localcluster.autoscaler).

The VLLMDeployment hands its Deployment's count to the autoscaler (`autoscaling.target:
Deployment`, a canary one pod beyond the count with `maxSurge: 1`). Asserted, from the API
server's audit log and the Deployment's managedFields: after the autoscaler's first write the
operator never writes the Deployment's spec.replicas (nor its /scale) although it applies the
Deployment again (the promotion changes its template); the autoscaler's count stands; the tuner
held while the count moved; and tuning still converges (a committed trial, SLO met).

Run: `.venv/bin/pytest e2e -m e2e -k autoscaler` (about eight minutes on two cores).
"""

from __future__ import annotations

import copy
import json
import time
import urllib.parse
from typing import Any

import pytest
from tests.support.waiting import wait_for

from e2e.conftest import MakeLoop
from e2e.harness import ClosedLoop, condition
from vllm_localcluster.autoscaler import FIELD_MANAGER, USER_AGENT, ScheduledScaler
from vllm_localcluster.demo import DEMO_DEPLOYMENT, DEMO_POLICY

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(720)]

OPERATOR_AGENTS = ("vllm-autotuner/", "kopf/")
SCHEDULE = (2, 1)  # the count the autoscaler writes, in turn, every PERIOD_S
PERIOD_S = 120.0
RATE = 5.0  # 'rag' requests per simulated second (the defaults violate ITL on one pod)


def objects() -> tuple[dict[str, Any], dict[str, Any]]:
    policy = copy.deepcopy(DEMO_POLICY)
    deployment = copy.deepcopy(DEMO_DEPLOYMENT)
    deployment["spec"].update(
        replicas=1,
        autoscaling={"target": "Deployment"},
        rollout={"maxSurge": 1, "maxUnavailable": 0},
    )
    return policy, deployment


def audit_events(loop: ClosedLoop) -> list[dict[str, Any]]:
    plane = loop.cluster.control_plane
    assert plane is not None
    lines = plane.audit_log.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def writes_replicas(event: dict[str, Any], name: str) -> bool:
    """A write to the Deployment `name` that sets spec.replicas, or to its /scale."""
    ref = event.get("objectRef") or {}
    if ref.get("resource") != "deployments" or ref.get("name") != name:
        return False
    if event.get("verb") not in ("create", "update", "patch"):
        return False
    body = event.get("requestObject")
    spec = (body or {}).get("spec") if isinstance(body, dict) else None
    return ref.get("subresource") == "scale" or (isinstance(spec, dict) and "replicas" in spec)


def by_operator(event: dict[str, Any]) -> bool:
    return str(event.get("userAgent", "")).startswith(OPERATOR_AGENTS)


def replicas_owners(deployment: dict[str, Any]) -> set[str]:
    return {
        str(entry["manager"])
        for entry in deployment["metadata"].get("managedFields") or []
        if "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {})
    }


def converged(loop: ClosedLoop) -> bool:
    assert loop.operator_alive(), loop.log_tail()
    status = loop.status()
    tuning = status.get("tuning") or {}
    committed = [t for t in tuning.get("trials") or [] if t.get("outcome") == "Committed"]
    met = condition(status, "SLOMet").get("status") == "True"
    return bool(committed) and met and tuning.get("phase") not in ("RollingOut", "Verifying")


def test_the_operator_tunes_beside_an_autoscaler_and_never_writes_its_count(
    closed_loop: MakeLoop,
) -> None:
    loop = closed_loop(audit=True)
    loop.apply(*objects())
    loop.start_operator()
    wait_for(lambda: loop.ready_endpoints() >= 1, 90, interval=0.5, message="a serving pod")
    name = loop.name
    path = f"/apis/apps/v1/namespaces/{loop.namespace}/deployments/{name}/scale"
    scaler = ScheduledScaler(
        loop.cluster.url, loop.cluster.token, str(loop.cluster.ca_file), path, SCHEDULE, PERIOD_S
    ).start()
    started = time.monotonic()
    try:
        # The load starts once the autoscaler owns the count: the tuner then rolls out (and
        # applies the Deployment) after the first scale, which the assertions below need. It
        # converges within one period, so a load started earlier finished its rollouts before.
        wait_for(lambda: scaler.writes, PERIOD_S + 30, interval=1.0, message="a first scale")
        loop.start_load("rag", rate=RATE, minutes=14.0)
        wait_for(
            lambda: converged(loop),
            timeout=540,
            interval=2.0,
            message="a committed trial and SLOMet=True beside the autoscaler",
        )
        # At least one more scale after the commit: the count keeps moving, and stands.
        writes_then = len(scaler.writes)
        wait_for(lambda: len(scaler.writes) > writes_then, PERIOD_S + 30, 1.0, "one more scale")
        last = scaler.writes[-1].after
        wait_for(
            lambda: (loop.deployment().get("spec") or {}).get("replicas") == last,
            10,
            message=f"the Deployment at the autoscaler's {last}",
        )
    finally:
        scaler.stop()
    took = time.monotonic() - started
    assert not scaler.errors, scaler.errors

    events = audit_events(loop)
    first_scale = next(
        i
        for i, e in enumerate(events)
        if e.get("userAgent") == USER_AGENT and (e.get("objectRef") or {}).get("subresource")
    )
    after = events[first_scale:]
    operator_writes = [e for e in after if by_operator(e) and writes_replicas(e, name)]
    assert operator_writes == [], [
        (e.get("verb"), e.get("requestURI"), e.get("requestObject")) for e in operator_writes
    ]
    # Not vacuous: the operator did apply the Deployment after the autoscaler took the count.
    applies = [
        e
        for e in after
        if by_operator(e)
        and e.get("verb") == "patch"
        and (e.get("objectRef") or {}).get("resource") == "deployments"
        and (e.get("objectRef") or {}).get("name") == name
    ]
    assert applies, "the operator never applied the Deployment after the first scale"
    autoscaler_writes = [
        e for e in after if e.get("userAgent") == USER_AGENT and e["verb"] == "update"
    ]
    assert len(autoscaler_writes) == len(scaler.writes)

    deployment = loop.deployment()
    owners = replicas_owners(deployment)
    assert owners == {FIELD_MANAGER}, owners
    status = loop.status()
    assert status["scaling"]["owner"] == "Deployment"
    assert status["scaling"]["replicas"] == last
    assert status["selector"] == f"vllm.autotuner.io/deployment={name}"
    assert status["capacity"]["perReplicaRps"] > 0
    assert status["capacity"]["knobs"] == status["tuning"]["applied"]
    # The tuner saw the count move and held (its decisions are logged as they change).
    log = loop.operator_log.read_text(errors="replace")
    assert "the replica count moves from" in log, loop.log_tail()
    tuning = status["tuning"]
    print(
        f"\nconverged beside the autoscaler in {took:.0f} s: {len(tuning['trials'])} trial(s), "
        f"{len(scaler.writes)} scale writes ({[w.after for w in scaler.writes]}), "
        f"{len(applies)} operator applies of the Deployment after the first scale, "
        f"0 of them with spec.replicas; capacity {status['capacity']['perReplicaRps']} req/s"
    )
    selector = urllib.parse.quote(f"vllm.autotuner.io/deployment={name}")
    pods = loop.get(f"/api/v1/namespaces/{loop.namespace}/pods?labelSelector={selector}")
    assert pods is not None and pods.get("items")
