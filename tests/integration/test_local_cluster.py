"""LocalCluster: the real control plane + node agent + real Prometheus, and nothing left
running afterwards."""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.prometheus import wait_for_query
from tests.support.waiting import wait_for
from vllm_autotuner import API_VERSION
from vllm_localcluster.cluster import LocalCluster

pytestmark = pytest.mark.prometheus

MODEL = "Qwen/Qwen2.5-7B-Instruct"


def children() -> set[int]:
    """Live (non-zombie) processes whose parent is this test process, read from /proc."""
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[1]) == os.getpid():
            found.add(int(entry.name))
    return found


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def listening(url: str) -> bool:
    host, port = url.split("://")[1].split(":")
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, int(port))) == 0


def api(cluster: LocalCluster, method: str, path: str, body: Any = None) -> Any:
    status, answer = cluster.request(method, path, body)
    assert status < 400, (status, answer)
    return answer


def serve(cluster: LocalCluster, namespace: str, name: str) -> None:
    """A namespace, a Deployment of one vllm-sim pod, and a Service in front of it."""
    if namespace != "default":
        api(cluster, "POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    api(cluster, "POST", f"/apis/apps/v1/namespaces/{namespace}/deployments", deployment(name))
    service = {
        "metadata": {"name": name},
        "spec": {"selector": {"app": name}, "ports": [{"port": 8000, "targetPort": 8000}]},
    }
    api(cluster, "POST", f"/api/v1/namespaces/{namespace}/services", service)


def deployment(name: str) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "vllm/vllm-openai",
                            "command": ["vllm", "serve"],
                            "args": [MODEL, "--port", "8000", "--max-num-seqs", "8"],
                        }
                    ]
                },
            },
        },
    }


def test_cluster_serves_pods_to_prometheus_and_leaves_nothing_behind(tmp_path: Path) -> None:
    before = children()
    cluster = LocalCluster(
        tmp_path / "cluster", time_scale=2.0, sim_env={"VLLM_SIM_LOAD_TIME": "0.2"}
    )
    with cluster:
        # The CRDs are served before anyone applies a VLLMDeployment.
        listed = api(cluster, "GET", f"/apis/{API_VERSION}/vllmdeployments")
        assert listed["items"] == []
        assert "server: https://127.0.0.1:" in cluster.kubeconfig.read_text()
        serve(cluster, "team", "chat")
        endpoints = wait_for(lambda: cluster.endpoints("team", "chat"), timeout=30, message="pod")
        pod_name = endpoints[0][0]
        assert cluster.prometheus is not None
        result = wait_for_query(
            cluster.prometheus,
            '{__name__=~"vllm[:_]num_requests_running",job="vllm",namespace="team"}',
            timeout=30,
        )
        assert result[0]["metric"]["pod"] == pod_name
        assert result[0]["metric"]["container"] == "vllm"
        pids = cluster.pids()
        # One pod, Prometheus, etcd, kube-apiserver, controller manager, scheduler.
        assert len(pids) == 6 and all(map(running, pids))
        urls = [cluster.url, cluster.prometheus_url, endpoints[0][1]]
    assert not any(map(running, pids)), "a process survived stop()"
    assert children() <= before
    assert not any(map(listening, urls))
    # Logs stay in a workdir the caller chose.
    assert (tmp_path / "cluster" / "pods" / "team" / f"{pod_name}.log").exists()


def test_an_exception_inside_the_cluster_still_stops_everything(tmp_path: Path) -> None:
    before = children()
    cluster = LocalCluster(with_prometheus=False, sim_env={"VLLM_SIM_LOAD_TIME": "0.2"})
    with pytest.raises(KeyboardInterrupt), cluster:  # what Ctrl-C raises
        workdir = cluster.workdir
        serve(cluster, "default", "a")
        wait_for(lambda: cluster.endpoints("default", "a"), timeout=30, message="pod")
        pids = cluster.pids()
        assert pids and all(map(running, pids))
        raise KeyboardInterrupt
    assert not any(map(running, pids))
    assert children() <= before
    assert not workdir.exists()  # a temporary workdir is removed


CHILD = """
import json, sys, threading, time
from vllm_localcluster.cluster import LocalCluster
cluster = LocalCluster(with_prometheus=False, sim_env={"VLLM_SIM_LOAD_TIME": "0.2"}).start()
cluster.request("POST", "/apis/apps/v1/namespaces/default/deployments", json.loads(sys.argv[1]))
deadline = time.monotonic() + 30
while not cluster.agent.pids() and time.monotonic() < deadline:
    threading.Event().wait(0.05)
print(json.dumps(sorted(cluster.pids())), flush=True)
threading.Event().wait(120)
"""


def test_a_killed_cluster_process_takes_its_pods_with_it(tmp_path: Path) -> None:
    """SIGKILL leaves no time for cleanup; the kernel must stop the pods and the control plane
    (setpriv pdeathsig)."""
    if shutil.which("setpriv") is None:
        pytest.skip("util-linux setpriv is not installed")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(deployment("a"))],
        stdout=subprocess.PIPE,
        cwd=tmp_path,
    )
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 40)
        assert ready, "the child cluster did not report its pods"
        pids = json.loads(child.stdout.readline())
        assert pids and all(map(running, pids))
    finally:
        child.kill()
        child.wait(10)
    wait_for(lambda: not any(map(running, pids)), timeout=10, message="orphaned pods gone")
