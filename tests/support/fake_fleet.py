"""Stand-ins for the kubelet and for Prometheus, for operator tests that need no processes.

`FakeKubelet` turns each Deployment's current template into one Pod object (ready, or
crash-looping for knobs listed as bad) the way the Deployment controller and kubelet would
report it. `SyntheticSnapshots` answers the operator's snapshot requests with a plausible
latency model of the knobs, so decide() has something to act on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import requests
from bench.scale.kubelet import pod_owner, replicaset_for

from tests.support.cluster_api import ApiServer
from vllm_autotuner.adapters.promql import SnapshotTarget
from vllm_autotuner.core.render import KNOBS_ANNOTATION
from vllm_autotuner.core.snapshot import KVCacheInfo, LatencySummary, LengthSummary, Snapshot
from vllm_autotuner.core.tuning_inputs import parse_knob_label
from vllm_autotuner.core.tuning_types import Knobs


def _now() -> str:
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeKubelet:
    """One pod per Deployment, on the current template; old revisions are replaced at once."""

    def __init__(
        self,
        server: ApiServer | str,
        namespace: str,
        is_bad: Callable[[Knobs | None], bool] = lambda _: False,
        interval_s: float = 0.2,
    ) -> None:
        self.url = server if isinstance(server, str) else server.url
        self.namespace = namespace
        self.is_bad = is_bad
        self.interval_s = interval_s
        if isinstance(server, str):  # the API emulator of the fault-injection tests
            self.session = requests.Session()
            self.session.headers["User-Agent"] = "fake-kubelet"
        else:
            self.session = server.session("fake-kubelet")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-kubelet", daemon=True)
        self.revisions_seen: list[str] = []

    def __enter__(self) -> FakeKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(requests.RequestException):  # the emulator may be stopping
                self.sync()
            self._stop.wait(self.interval_s)

    def _json(self, method: str, path: str, body: Any = None, ctype: str | None = None) -> Any:
        headers = {"Content-Type": ctype} if ctype else {}
        r = self.session.request(
            method,
            self.url + path,
            data=None if body is None else json.dumps(body),
            headers=headers,
            timeout=5,
        )
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()

    def sync(self) -> None:
        ns = self.namespace
        deployments = self._json("GET", f"/apis/apps/v1/namespaces/{ns}/deployments") or {}
        pods = (self._json("GET", f"/api/v1/namespaces/{ns}/pods") or {}).get("items", [])
        for dep in deployments.get("items", []):
            name = dep["metadata"]["name"]
            template = dep["spec"]["template"]
            revision = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[
                :10
            ]
            mine = [p for p in pods if p["metadata"].get("labels", {}).get("fake-owner") == name]
            for pod in mine:
                if pod["metadata"]["labels"].get("pod-template-hash") != revision:
                    self._json("DELETE", f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}")
            current = [
                p for p in mine if p["metadata"]["labels"].get("pod-template-hash") == revision
            ]
            if not current:
                self._create_pod(dep, revision)
                if revision not in self.revisions_seen:
                    self.revisions_seen.append(revision)
            self._json(
                "PATCH",
                f"/apis/apps/v1/namespaces/{ns}/deployments/{name}/status",
                {"status": self._deployment_status(dep, revision)},
                "application/merge-patch+json",
            )

    def pod_owners(
        self, dep: dict[str, Any], revision: str, labels: dict[str, str]
    ) -> list[dict[str, Any]]:
        """The ReplicaSet of this revision (created when missing), as the pod's owner: the
        operator counts only pods a ReplicaSet of its Deployment controls."""
        ns, name = self.namespace, dep["metadata"]["name"]
        rs_path = f"/apis/apps/v1/namespaces/{ns}/replicasets"
        rs = self._json("GET", f"{rs_path}/{name}-{revision}") or self._json(
            "POST", rs_path, replicaset_for(dep, revision, labels), "application/json"
        )
        return [pod_owner(f"{name}-{revision}", rs["metadata"]["uid"])]

    def _create_pod(self, dep: dict[str, Any], revision: str) -> None:
        ns, name = self.namespace, dep["metadata"]["name"]
        template = dep["spec"]["template"]
        annotations = dict(template["metadata"].get("annotations") or {})
        knobs = parse_knob_label(annotations.get(KNOBS_ANNOTATION))
        bad = self.is_bad(knobs)
        labels = {
            **template["metadata"].get("labels", {}),
            "pod-template-hash": revision,
            "fake-owner": name,
        }
        container_status: dict[str, Any] = {"name": "vllm", "ready": not bad, "restartCount": 0}
        if bad:
            container_status.update(
                restartCount=3,
                state={"waiting": {"reason": "CrashLoopBackOff"}},
                lastState={"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
            )
        else:
            container_status["state"] = {"running": {"startedAt": _now()}}
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
        self._json("POST", f"/api/v1/namespaces/{ns}/pods", pod, "application/json")
        status = {
            "phase": "Running",
            "conditions": [
                {
                    "type": "Ready",
                    "status": "False" if bad else "True",
                    "lastTransitionTime": _now(),
                }
            ],
            "containerStatuses": [container_status],
        }
        self._json(
            "PATCH",
            f"/api/v1/namespaces/{ns}/pods/{name}-{revision}/status",
            {"status": status},
            "application/merge-patch+json",
        )

    def _deployment_status(self, dep: dict[str, Any], revision: str) -> dict[str, Any]:
        knobs = parse_knob_label(
            (dep["spec"]["template"]["metadata"].get("annotations") or {}).get(KNOBS_ANNOTATION)
        )
        ready = 0 if self.is_bad(knobs) else 1
        return {
            "observedGeneration": dep["metadata"].get("generation", 1),
            "replicas": 1,
            "updatedReplicas": 1,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "conditions": [
                {
                    "type": "Available",
                    "status": "True" if ready else "False",
                    "reason": "MinimumReplicasAvailable",
                }
            ],
        }


def _latency(p50: float, p95: float) -> LatencySummary:
    return LatencySummary(
        p50_ms=p50,
        p90_ms=p50 + 0.8 * (p95 - p50),
        p95_ms=p95,
        p99_ms=p95 * 1.2,
        at_slo_ms=p95,
        mean_ms=p50 * 1.05,
    )


@dataclass
class SyntheticSnapshots:
    """A long-prompt (RAG-like) fleet: prefill chunks set the ITL tail.

    Steps that carry a prefill chunk take longer the larger the token budget lets the chunk
    be, so the ITL p95 grows with max_num_batched_tokens while TTFT needs more steps when it
    shrinks — the trade-off the tuner is there to find.
    """

    rate: float = 2.0
    window_s: float = 60.0
    calls: list[list[SnapshotTarget]] = field(default_factory=list)
    available: bool = True
    decode_ms: float = 12.0
    ms_per_prefill_token: float = 0.008
    long_prompt: int = 7000

    def step_with_chunk(self, k: Knobs) -> float:
        chunk = min(k.max_num_batched_tokens, self.long_prompt)
        return self.decode_ms + self.ms_per_prefill_token * chunk

    def itl_p95(self, k: Knobs) -> float:
        return self.step_with_chunk(k)

    def ttft_p95(self, k: Knobs) -> float:
        steps = -(-self.long_prompt // k.max_num_batched_tokens)
        return 80.0 + steps * self.step_with_chunk(k)

    async def snapshots(
        self, targets: Sequence[SnapshotTarget], now: datetime
    ) -> dict[tuple[str, str], Snapshot]:
        self.calls.append(list(targets))
        out: dict[tuple[str, str], Snapshot] = {}
        for t in targets:
            if not self.available or t.knobs is None or not t.pods:
                why = "Prometheus unreachable (test)" if not self.available else "no ready pods"
                out[t.key] = Snapshot.unavailable(now, t.window_s, why)
                continue
            k = t.knobs
            itl, ttft = self.itl_p95(k), self.ttft_p95(k)
            out[t.key] = Snapshot(
                time=now,
                window_s=self.window_s,
                revision=t.revision,
                knobs=k,
                num_pods=len(t.pods),
                request_rate=self.rate,
                completed_requests=int(self.rate * self.window_s),
                ttft=_latency(ttft * 0.6, ttft),
                itl=LatencySummary(
                    p50_ms=self.decode_ms,
                    p90_ms=self.decode_ms * 1.5,
                    p95_ms=itl,
                    p99_ms=itl * 1.1,
                    at_slo_ms=itl,
                    mean_ms=self.decode_ms * 1.3,
                ),
                e2e=_latency(ttft + 150 * self.decode_ms * 1.3, ttft + 300 * itl),
                queue_time=_latency(1.0, 5.0),
                ttft_attainment=1.0 if ttft <= 800 else 0.8,
                itl_attainment=1.0 if itl <= 50 else 0.6,
                kv_usage_mean=0.3,
                kv_usage_max=0.45,
                preemption_rate=0.0,
                running_mean=30.0,
                running_max=45.0,
                waiting_mean=0.0,
                waiting_max=1.0,
                prompt_len=LengthSummary(mean=4000, p50=3800, p90=self.long_prompt),
                generation_len=LengthSummary(mean=150, p50=140, p90=300),
                prefix_cache_hit_rate=0.1,
                iteration_tokens_mean=900.0,
                kv_cache=KVCacheInfo(
                    num_gpu_blocks=30000,
                    block_size=16,
                    kv_cache_size_tokens=480000,
                    gpu_memory_utilization=k.gpu_memory_utilization,
                ),
            )
        return out
