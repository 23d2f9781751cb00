"""The node agent honours termination as the kubelet does, and the Service proxy as kube-proxy.

A plain Python process stands in for vLLM: it serves 200 on its pod address, and on SIGTERM
writes the time and keeps running for a while (as a draining server does), so the test reads
when each step happened: preStop, SIGTERM, exit or SIGKILL, removal of the pod object.
"""

from __future__ import annotations

import contextlib
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.waiting import wait_for
from vllm_localcluster.cluster import LocalCluster
from vllm_localcluster.service_proxy import ServiceProxy

NS = "default"

# Serves GET / on the pod's own address; on SIGTERM notes the time, then exits after
# `drain` seconds (0: never, so only SIGKILL stops it).
PLAIN = """
import http.server, os, signal, sys, threading, time
drain = float(sys.argv[1])
out = sys.argv[2]
def on_term(*_):
    with open(out, "a") as f:
        f.write(f"SIGTERM {time.time():.3f}\\n")
    if drain > 0:
        threading.Timer(drain, lambda: os._exit(0)).start()
signal.signal(signal.SIGTERM, on_term)
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
        self.wfile.write(os.environ["POD_NAME"].encode())
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer((os.environ["POD_IP"], 8000), Handler)
server.serve_forever()
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    workdir = tmp_path_factory.mktemp("node-agent")
    with LocalCluster(workdir, with_prometheus=False, run_any_command=True) as running:
        yield running


def call(cluster: LocalCluster, method: str, path: str, body: Any = None) -> Any:
    status, answer = cluster.request(method, path, body)
    assert status < 400, (status, answer)
    return answer


def plain_deployment(
    name: str, notes: Path, *, replicas: int, grace_s: int, drain_s: float, pre_stop: Any
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": "python",
        "command": [sys.executable, "-c", PLAIN, str(drain_s), str(notes)],
        "ports": [{"containerPort": 8000, "name": "http"}],
        "readinessProbe": {"httpGet": {"path": "/", "port": 8000}, "periodSeconds": 1},
    }
    if pre_stop is not None:
        container["lifecycle"] = {"preStop": pre_stop}
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"terminationGracePeriodSeconds": grace_s, "containers": [container]},
            },
        },
    }


def deploy(cluster: LocalCluster, body: dict[str, Any]) -> list[str]:
    """Create the Deployment and its Service; the names of its pods once all are ready."""
    name = body["metadata"]["name"]
    call(cluster, "POST", f"/apis/apps/v1/namespaces/{NS}/deployments", body)
    service = {
        "metadata": {"name": name},
        "spec": {"selector": {"app": name}, "ports": [{"port": 80, "targetPort": "http"}]},
    }
    call(cluster, "POST", f"/api/v1/namespaces/{NS}/services", service)
    replicas = body["spec"]["replicas"]
    ready = wait_for(
        lambda: len(cluster.endpoints(NS, name)) == replicas or None,
        timeout=60,
        message=f"{replicas} ready endpoints of {name}",
    )
    assert ready
    return [pod for pod, _ in cluster.endpoints(NS, name)]


def pod_exists(cluster: LocalCluster, pod: str) -> bool:
    status, _ = cluster.request("GET", f"/api/v1/namespaces/{NS}/pods/{pod}")
    return status == 200


def sigterm_time(notes: Path) -> float | None:
    with contextlib.suppress(OSError):
        for line in notes.read_text().splitlines():
            if line.startswith("SIGTERM"):
                return float(line.split()[1])
    return None


def log_of(cluster: LocalCluster, pod: str) -> str:
    return (cluster.workdir / "pods" / NS / f"{pod}.log").read_text()


@pytest.mark.parametrize(
    "pre_stop",
    [
        {"sleep": {"seconds": 2}},
        {"exec": {"command": ["sleep", "2"]}},
        {"exec": {"command": ["/bin/sh", "-c", "sleep 2"]}},
    ],
    ids=["native-sleep", "exec-sleep", "shell-sleep"],
)
def test_pre_stop_runs_before_sigterm_and_a_drained_exit_removes_the_pod(
    cluster: LocalCluster, tmp_path: Path, pre_stop: dict[str, Any]
) -> None:
    name = f"drain-{next(iter(pre_stop))}-{len(str(pre_stop))}"
    notes = tmp_path / "notes"
    body = plain_deployment(name, notes, replicas=1, grace_s=20, drain_s=1.0, pre_stop=pre_stop)
    (pod,) = deploy(cluster, body)
    deleted_at = time.time()
    call(cluster, "DELETE", f"/api/v1/namespaces/{NS}/pods/{pod}")
    # From the deletion on, the endpoint is not ready: the proxy sends it nothing new.
    wait_for(
        lambda: pod not in [p for p, _ in cluster.endpoints(NS, name)],
        timeout=10,
        message="the terminating pod leaves the ready endpoints",
    )
    sigterm = wait_for(lambda: sigterm_time(notes), timeout=15, message="SIGTERM")
    gone = wait_for(lambda: not pod_exists(cluster, pod), timeout=20, message="pod removed")
    removed_at = time.time()
    assert gone
    # preStop delayed SIGTERM by its 2 s; the process drained 1 s and exited by itself.
    assert sigterm - deleted_at >= 2.0
    assert sigterm - deleted_at < 6.0
    assert removed_at - sigterm >= 1.0
    log = log_of(cluster, pod)
    assert log.index("preStop: sleeping 2 s") < log.index("SIGTERM (grace")
    assert "SIGKILL" not in log


def test_sigkill_comes_when_the_grace_period_counted_from_the_deletion_runs_out(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    notes = tmp_path / "notes"
    pre_stop = {"sleep": {"seconds": 1}}
    body = plain_deployment("stubborn", notes, replicas=1, grace_s=4, drain_s=0, pre_stop=pre_stop)
    (pod,) = deploy(cluster, body)
    deleted_at = time.time()
    call(cluster, "DELETE", f"/api/v1/namespaces/{NS}/pods/{pod}")
    sigterm = wait_for(lambda: sigterm_time(notes), timeout=15, message="SIGTERM")
    wait_for(lambda: not pod_exists(cluster, pod), timeout=20, message="pod removed")
    removed_at = time.time()
    # The process ignores SIGTERM: it dies at deletion + 4 s, not at SIGTERM + 4 s.
    assert sigterm - deleted_at >= 1.0
    assert 3.0 <= removed_at - deleted_at < 7.0
    log = log_of(cluster, pod)
    assert log.index("preStop") < log.index("SIGTERM (grace") < log.index("SIGKILL")


def test_the_service_proxy_routes_only_to_ready_non_terminating_endpoints(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    notes = tmp_path / "notes"
    pre_stop = {"sleep": {"seconds": 3}}
    body = plain_deployment("routed", notes, replicas=2, grace_s=20, drain_s=3.0, pre_stop=pre_stop)
    pods = deploy(cluster, body)
    proxy = ServiceProxy.for_service(cluster.api_endpoint(), NS, "routed").start_in_thread()
    try:

        def answer() -> str:
            with urllib.request.urlopen(proxy.url + "/", timeout=5) as response:
                return str(response.read().decode())

        wait_for(lambda: proxy.endpoints() or None, timeout=10, message="proxy endpoints")
        assert {answer() for _ in range(6)} == set(pods)
        leaving, staying = pods
        call(cluster, "DELETE", f"/api/v1/namespaces/{NS}/pods/{leaving}")
        wait_for(
            lambda: [p for p, _ in proxy.endpoints()] == [staying] or None,
            timeout=10,
            message="the proxy drops the terminating pod",
        )
        # The terminating pod is still running (preStop, then a 3 s drain), but gets nothing.
        assert sigterm_time(notes) is None or pod_exists(cluster, leaving)
        assert {answer() for _ in range(6)} == {staying}
    finally:
        proxy.stop()


def test_a_pod_that_is_not_vllm_is_refused_without_run_any_command(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "c", with_prometheus=False) as strict:
        body = plain_deployment("refused", tmp_path / "n", replicas=1, grace_s=1, drain_s=0,
                                pre_stop=None)  # fmt: skip
        call(strict, "POST", f"/apis/apps/v1/namespaces/{NS}/deployments", body)

        def waiting_reason() -> str | None:
            pods = call(strict, "GET", f"/api/v1/namespaces/{NS}/pods")["items"]
            for pod in pods:
                for status in (pod.get("status") or {}).get("containerStatuses") or []:
                    waiting = status["state"].get("waiting") or {}
                    return waiting.get("reason")
            return None

        reason = wait_for(waiting_reason, timeout=30, message="a container status")
        assert reason == "CreateContainerError"
        with contextlib.suppress(urllib.error.URLError):
            assert strict.endpoints(NS, "refused") == []
