"""Helpers for the reliability tests: faulty metrics, a configurable operator, cluster reads.

The reliability tests break one thing at a time (the API server, Prometheus, the pods, the
operator process, the policy) and check that the operator never makes things worse. What they
share lives here: a snapshot source whose failures the test switches on and off, an operator
runner that takes a full `OperatorConfig`, "kill switches" built on the fault proxy in front
of the real API server (vllm_localcluster.faults), and readers for the Deployment's knobs, the
tuning status and the Events.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, TypeVar

import pytest

from tests.support.cluster_api import (
    CR,
    CR_PATH,
    DEPLOYMENT_PATH,
    NS,
    Api,
    ApiServer,
    args_of,
    condition,
)
from tests.support.fake_fleet import FakeKubelet, SyntheticSnapshots
from tests.support.operator_runner import OperatorThread
from tests.support.waiting import wait_for
from vllm_autotuner.adapters.kube import USER_AGENT, KubeCredentials
from vllm_autotuner.adapters.promql import SnapshotTarget
from vllm_autotuner.core.render import KNOBS_ANNOTATION
from vllm_autotuner.core.snapshot import LatencySummary, Snapshot
from vllm_autotuner.core.tuning_inputs import parse_knob_label
from vllm_autotuner.core.tuning_types import Knobs
from vllm_autotuner.observer import SnapshotSource
from vllm_autotuner.operator import OperatorConfig
from vllm_localcluster.faults import Fault, FaultProxy, RequestRecord

START = Knobs(max_num_batched_tokens=8192, max_num_seqs=256, gpu_memory_utilization=0.92)
WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})


def fast_policy(name: str = "default", **rollout: Any) -> dict[str, Any]:
    """A policy whose windows are seconds long, so a whole trial fits in a test."""
    return {
        "apiVersion": "vllm.autotuner.io/v1alpha1",
        "kind": "VLLMTuningPolicy",
        "metadata": {"name": name},
        "spec": {
            "slo": {
                "ttft": {"percentile": 95, "thresholdMs": 800},
                "itl": {"percentile": 95, "thresholdMs": 50},
            },
            "minRequestsPerWindow": 20,
            "evaluationWindow": "2s",
            "rollout": {
                "minInterval": "0s",
                "maxPerDay": 20,
                "verifyWindow": "2s",
                "readyTimeout": "30s",
                **rollout,
            },
        },
    }


def cr_with_mode(mode: str, **spec: Any) -> dict[str, Any]:
    cr: dict[str, Any] = copy.deepcopy(CR)
    cr["spec"]["tuning"] = {"mode": mode}
    cr["spec"].update(spec)
    return cr


# ------------------------------------------------------------------------------ cluster reads


def knobs_of(deployment: dict[str, Any] | None) -> Knobs | None:
    """The three knobs in the Deployment's vLLM args (None when there is no Deployment)."""
    if deployment is None:
        return None
    args = args_of(deployment)
    return Knobs(
        int(args[args.index("--max-num-batched-tokens") + 1]),
        int(args[args.index("--max-num-seqs") + 1]),
        float(args[args.index("--gpu-memory-utilization") + 1]),
    )


def live_knobs(api: Api) -> Knobs | None:
    return knobs_of(api.get(f"{DEPLOYMENT_PATH}/llama"))


def status_of(api: Api) -> dict[str, Any]:
    return dict(((api.get(f"{CR_PATH}/llama") or {}).get("status")) or {})


def tuning_of(api: Api) -> dict[str, Any]:
    return dict(status_of(api).get("tuning") or {})


def trials_of(api: Api) -> list[dict[str, Any]]:
    return list(tuning_of(api).get("trials") or [])


def cond(api: Api, cond_type: str) -> dict[str, Any]:
    return condition(api.get(f"{CR_PATH}/llama"), cond_type) or {}


def events(api: Api, reason: str | None = None) -> list[dict[str, Any]]:
    """Events about the VLLMDeployment (optionally with one reason), oldest first."""
    found = (api.get(f"/api/v1/namespaces/{NS}/events") or {}).get("items", [])
    mine = [
        e
        for e in found
        if (e.get("involvedObject") or {}).get("kind") == "VLLMDeployment"
        and (reason is None or e.get("reason") == reason)
    ]
    return sorted(mine, key=lambda e: str(e["metadata"].get("resourceVersion", "")).zfill(20))


def deployment_versions(proxy: FaultProxy) -> list[dict[str, Any]]:
    """Every Deployment the operator successfully applied through the proxy, in order: the
    versions the object had (the operator is its only writer of the template)."""
    return [
        r.body
        for r in proxy.requests_matching(resource="deployments", name="llama", verb="patch")
        if isinstance(r.body, dict) and r.status_code is not None and r.status_code < 300
    ]


def template_history(proxy: FaultProxy) -> list[Knobs]:
    """Every distinct pod-template knob setting the Deployment had, in order (no repeats).

    A rollout is a change of the pod template's knobs; counting them from the applies that
    reached the API server is what tells "one rollout" from "two" after a restart.
    """
    seen: list[Knobs] = []
    for obj in deployment_versions(proxy):
        k = knobs_of(obj)
        if k is not None and (not seen or not seen[-1].same_as(k)):
            seen.append(k)
    return seen


# ------------------------------------------------------------------------------- API faults


def by_operator(record: RequestRecord) -> bool:
    """A request made by the operator's own client (not by kopf's watches or the test)."""
    return (record.user_agent or "").startswith(USER_AGENT)


def operator_write(record: RequestRecord) -> bool:
    return by_operator(record) and record.verb in WRITE_VERBS


def status_patch(record: RequestRecord) -> bool:
    return (
        by_operator(record)
        and record.verb == "patch"
        and record.resource == "vllmdeployments"
        and record.subresource == "status"
    )


def deployment_apply(record: RequestRecord) -> bool:
    return (
        by_operator(record)
        and record.verb == "patch"
        and record.resource == "deployments"
        and record.content_type is not None
        and "apply-patch" in record.content_type
    )


def freeze_when(
    proxy: FaultProxy,
    trigger: Callable[[], bool],
    which: Callable[[RequestRecord], bool] = operator_write,
) -> Fault:
    """From the moment `trigger()` holds, every `which` request fails with 503, forever.

    This is the observable effect of killing the operator at that instant: nothing it does
    afterwards reaches the cluster. The trigger is checked by the proxy when the request
    arrives, so the "kill" lands exactly between two writes. Returns the fault (its `hits`
    counts the writes that were lost).
    """
    armed = {"on": False}

    def match(record: RequestRecord) -> bool:
        if not which(record):
            return False
        if not armed["on"]:
            armed["on"] = bool(trigger())
        return armed["on"]

    return proxy.inject(match, status=503, times=None, message="operator killed")


def phase_is(api: Api, phase: str) -> Callable[[], bool]:
    """A trigger reading the stored status straight from the API server (not the proxy)."""

    def check() -> bool:
        return tuning_of(api).get("phase") == phase

    return check


def compact(proxy: FaultProxy, api: Api) -> int:
    """The history before now is gone: watches resuming from an older resourceVersion get
    410 Gone from here on. Returns the resourceVersion of now."""
    listed = api.get(f"/api/v1/namespaces/{NS}/configmaps") or {}
    now = int(listed["metadata"]["resourceVersion"])
    proxy.expire_watches_before(now)
    return now


@pytest.fixture
def proxy(apiserver: ApiServer) -> Iterator[FaultProxy]:
    """A proxy to the session's API server; clients without credentials act as the operator."""
    proxy = FaultProxy(apiserver.url, str(apiserver.ca_file), token=apiserver.operator_token)
    proxy.start_in_thread()
    try:
        yield proxy
    finally:
        proxy.stop()


# ------------------------------------------------------------------------------ the operator


def operator_config(
    proxy: FaultProxy, *, interval_s: float = 0.5, request_timeout_s: float = 5.0, **extra: Any
) -> OperatorConfig:
    """The operator behind the fault proxy (plain HTTP; the proxy adds its token)."""
    return OperatorConfig(
        credentials=KubeCredentials.for_server(proxy.url),
        reconcile_interval_s=interval_s,
        request_timeout_s=request_timeout_s,
        **extra,
    )


@contextmanager
def operator(
    config: OperatorConfig, snapshot_source: SnapshotSource | None = None
) -> Iterator[OperatorThread]:
    """The real kopf operator in a thread, with every setting of `config` (timeouts too)."""
    thread = OperatorThread(config, None, snapshot_source).start()
    try:
        yield thread
    finally:
        thread.stop()


# ---------------------------------------------------------------------------- metric faults


@dataclass
class FaultySnapshots:
    """The synthetic fleet behind a Prometheus the test can break and repair at will.

    `mode` is what the next cycles return: "ok"; "down" (the source raises, as a client whose
    server vanished would); "unavailable" (the adapter's own verdict, with a reason);
    "partial" (the ITL series is missing); "nan" (percentiles and rates are NaN);
    "reset" (a counter reset after a pod restart made the request rate negative).
    `served` records the mode of every target answered, so tests know the bad data was seen.
    """

    inner: SyntheticSnapshots = field(default_factory=SyntheticSnapshots)
    mode: str = "ok"
    served: list[str] = field(default_factory=list)

    async def snapshots(
        self, targets: Sequence[SnapshotTarget], now: datetime
    ) -> dict[tuple[str, str], Snapshot]:
        mode = self.mode
        if mode == "down":
            self.served.append(mode)
            raise ConnectionRefusedError("Prometheus is down (test)")
        good = await self.inner.snapshots(targets, now)
        out: dict[tuple[str, str], Snapshot] = {}
        for key, snap in good.items():
            if snap.available:
                self.served.append(mode)
            out[key] = self._spoil(snap, mode, now) if snap.available else snap
        return out

    @staticmethod
    def _spoil(snap: Snapshot, mode: str, now: datetime) -> Snapshot:
        nan = math.nan
        if mode == "unavailable":
            return Snapshot.unavailable(now, snap.window_s, "Prometheus answered 503 (test)")
        if mode == "partial":
            return replace(snap, itl=LatencySummary(), itl_attainment=None)
        if mode == "nan":
            return replace(
                snap,
                itl=LatencySummary(nan, nan, nan, nan, nan, nan),
                ttft=LatencySummary(nan, nan, nan, nan, nan, nan),
                request_rate=nan,
            )
        if mode == "reset":
            return replace(snap, request_rate=-abs(snap.request_rate) - 1.0)
        return snap


# ------------------------------------------------------------------------------- pod faults


class FaultyKubelet(FakeKubelet):
    """A FakeKubelet whose pods can also hang before ready or crash without an OOM.

    `stuck(knobs)`: the pod is created but never becomes ready (image pull, a slow model
    load: no crash, no restart). `crashing(knobs)`: CrashLoopBackOff after exit code 1
    ("Error"), so the failure is a crash and not a memory problem. Other knobs behave as in
    FakeKubelet (including its `is_bad`, which means OOMKilled).
    """

    def __init__(
        self,
        server: ApiServer,
        namespace: str,
        *,
        stuck: Callable[[Knobs | None], bool] = lambda _: False,
        crashing: Callable[[Knobs | None], bool] = lambda _: False,
        **options: Any,
    ) -> None:
        super().__init__(server, namespace, **options)
        self.stuck = stuck
        self.crashing = crashing

    def _create_pod(self, dep: dict[str, Any], revision: str) -> None:
        template = dep["spec"]["template"]
        annotations = dict(template["metadata"].get("annotations") or {})
        knobs = parse_knob_label(annotations.get(KNOBS_ANNOTATION))
        if not (self.stuck(knobs) or self.crashing(knobs)):
            super()._create_pod(dep, revision)
            return
        ns, name = self.namespace, dep["metadata"]["name"]
        labels = {
            **template["metadata"].get("labels", {}),
            "pod-template-hash": revision,
            "fake-owner": name,
        }
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{name}-{revision}",
                "namespace": ns,
                "labels": labels,
                "annotations": annotations,
                "ownerReferences": self.pod_owners(dep, revision, labels),
            },
            "spec": template["spec"],
        }
        container: dict[str, Any] = {"name": "vllm", "ready": False, "restartCount": 0}
        if self.crashing(knobs):
            container.update(
                restartCount=4,
                state={"waiting": {"reason": "CrashLoopBackOff"}},
                lastState={"terminated": {"exitCode": 1, "reason": "Error"}},
            )
        else:
            container["state"] = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
        status = {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [container],
        }
        self._json("POST", f"/api/v1/namespaces/{ns}/pods", pod, "application/json")
        self._json(
            "PATCH",
            f"/api/v1/namespaces/{ns}/pods/{name}-{revision}/status",
            {"status": status},
            "application/merge-patch+json",
        )


def oom_kill_later(api: Api, knobs: Knobs) -> str:
    """The running pod with `knobs` was OOM-killed and restarted (hours after its rollout):
    ready again, restartCount 1, lastState OOMKilled. Returns the pod's name."""
    pods = (api.get(f"/api/v1/namespaces/{NS}/pods") or {}).get("items", [])
    for pod in pods:
        labelled = parse_knob_label(
            (pod["metadata"].get("annotations") or {}).get(KNOBS_ANNOTATION)
        )
        if labelled is not None and labelled.same_as(knobs):
            name = str(pod["metadata"]["name"])
            container = {
                "name": "vllm",
                "ready": True,
                "restartCount": 1,
                "state": {"running": {"startedAt": "2026-01-01T03:00:00Z"}},
                "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
            }
            api.merge(
                f"/api/v1/namespaces/{NS}/pods/{name}/status",
                {"status": {"containerStatuses": [container]}},
            )
            return name
    raise AssertionError(f"no pod runs {knobs}")


T = TypeVar("T")


def wait_some(predicate: Callable[[], T | None], timeout: float, message: str) -> T:
    """`wait_for` for predicates that return a value or None (typed without the None)."""
    value = wait_for(predicate, timeout, message=message)
    assert value is not None
    return value


def cond_when(
    api: Api, cond_type: str, status: str, contains: str = ""
) -> Callable[[], dict[str, Any] | None]:
    """A predicate: the condition once it has `status` and its message contains `contains`
    (case-insensitive)."""

    def check() -> dict[str, Any] | None:
        c = cond(api, cond_type)
        ok = c.get("status") == status and contains.lower() in str(c.get("message", "")).lower()
        return c if ok else None

    return check
