"""The Deployment controller and kubelet of a simulated fleet, reduced to what the operator reads.

For every Deployment the operator manages, one ready Pod on the current template (labels and
the knobs annotation copied, as the ReplicaSet controller does) and a Deployment status that
says it is available. Pods become Ready "an hour ago", so the operator's evaluation window is
full at once and the benchmark measures steady state, not warm-up.

It writes only when a template changed, so in a quiet period it adds no writes of its own, and
its requests carry their own user agent so they are never counted as the operator's.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import requests

USER_AGENT = "bench-kubelet"


def replicaset_for(dep: dict[str, Any], revision: str, labels: dict[str, str]) -> dict[str, Any]:
    """A ReplicaSet `<deployment>-<revision>` controlled by `dep`, as the Deployment controller
    names and labels it."""
    meta = dep["metadata"]
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {
            "name": f"{meta['name']}-{revision}",
            "namespace": meta["namespace"],
            "labels": labels,
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "replicas": 1,
            "selector": dep["spec"]["selector"],
            "template": dep["spec"]["template"],
        },
    }


def pod_owner(rs_name: str, rs_uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "name": rs_name,
        "uid": rs_uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _stamp(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


class FleetKubelet:
    def __init__(
        self,
        url: str,
        on_pod: Callable[[str, str], None],
        interval_s: float = 2.0,
        session: requests.Session | None = None,
    ) -> None:
        self.url = url
        self.on_pod = on_pod  # (pod name, namespace): tells the Prometheus stub what to answer
        self.interval_s = interval_s
        # An authenticated session for the real API server; its user agent must start with
        # USER_AGENT so the benchmark never counts these writes as the operator's.
        self.session = session or requests.Session()
        if session is None:
            self.session.headers["User-Agent"] = USER_AGENT
        self.revisions: dict[tuple[str, str], str] = {}  # (ns, deployment) -> template hash
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-kubelet", daemon=True)

    def __enter__(self) -> FleetKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except requests.RequestException:
                self.errors += 1
            self._stop.wait(self.interval_s)

    def _send(self, method: str, path: str, body: Any, ctype: str) -> Any:
        r = self.session.request(
            method,
            self.url + path,
            data=json.dumps(body),
            headers={"Content-Type": ctype},
            timeout=30,
        )
        if r.status_code >= 400 and r.status_code != 409:
            r.raise_for_status()
        return r.json() if r.status_code < 400 else None

    def _replicaset(self, dep: dict[str, Any], revision: str, labels: dict[str, str]) -> str:
        """The ReplicaSet the Deployment controller would create for this revision; its uid.

        The operator counts only pods a ReplicaSet of its Deployment controls."""
        ns, name = dep["metadata"]["namespace"], dep["metadata"]["name"]
        path = f"/apis/apps/v1/namespaces/{ns}/replicasets"
        body = replicaset_for(dep, revision, labels)
        created = self._send("POST", path, body, "application/json")
        if created is None:
            r = self.session.get(f"{self.url}{path}/{name}-{revision}", timeout=30)
            r.raise_for_status()
            created = r.json()
        return str(created["metadata"]["uid"])

    def sync(self) -> int:
        """One pass over every Deployment; returns how many got a new pod."""
        r = self.session.get(self.url + "/apis/apps/v1/deployments", timeout=60)
        r.raise_for_status()
        changed = 0
        for dep in r.json().get("items", []):
            meta = dep["metadata"]
            key = (meta["namespace"], meta["name"])
            template = dep["spec"]["template"]
            revision = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()
            if self.revisions.get(key) == revision[:10]:
                continue
            old = self.revisions.get(key)
            if old is not None:
                self.session.delete(
                    f"{self.url}/api/v1/namespaces/{key[0]}/pods/{key[1]}-{old}", timeout=30
                )
            self._start_pod(dep, revision[:10])
            self.revisions[key] = revision[:10]
            changed += 1
        return changed

    def _start_pod(self, dep: dict[str, Any], revision: str) -> None:
        ns, name = dep["metadata"]["namespace"], dep["metadata"]["name"]
        template = dep["spec"]["template"]
        pod_name = f"{name}-{revision}"
        ready_at = _stamp(datetime.now(tz=UTC) - timedelta(hours=1))
        labels = {**(template["metadata"].get("labels") or {}), "pod-template-hash": revision}
        rs_uid = self._replicaset(dep, revision, labels)
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name,
                "namespace": ns,
                "labels": labels,
                "annotations": dict(template["metadata"].get("annotations") or {}),
                "ownerReferences": [pod_owner(pod_name, rs_uid)],
            },
            "spec": template["spec"],
        }
        self.on_pod(pod_name, ns)
        self._send("POST", f"/api/v1/namespaces/{ns}/pods", pod, "application/json")
        status = {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": ready_at}],
            "containerStatuses": [
                {
                    "name": "vllm",
                    "ready": True,
                    "restartCount": 0,
                    "state": {"running": {"startedAt": ready_at}},
                }
            ],
        }
        self._send(
            "PATCH",
            f"/api/v1/namespaces/{ns}/pods/{pod_name}/status",
            {"status": status},
            "application/merge-patch+json",
        )
        replicas = int(dep["spec"].get("replicas", 1))
        self._send(
            "PATCH",
            f"/apis/apps/v1/namespaces/{ns}/deployments/{name}/status",
            {
                "status": {
                    "observedGeneration": dep["metadata"].get("generation", 1),
                    "replicas": replicas,
                    "updatedReplicas": replicas,
                    "readyReplicas": replicas,
                    "availableReplicas": replicas,
                    "conditions": [
                        {
                            "type": "Available",
                            "status": "True",
                            "reason": "MinimumReplicasAvailable",
                        }
                    ],
                }
            },
            "application/merge-patch+json",
        )
