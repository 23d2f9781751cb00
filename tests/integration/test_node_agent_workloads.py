"""The node agent under the real control plane, with real `vllm-sim serve` processes.

Everything goes through the API as a user (or the operator) would: a Deployment is created
over HTTP; kube-controller-manager's Deployment and ReplicaSet controllers create the pods,
kube-scheduler binds them, and the node agent runs them. The test watches Pods, ReplicaSets
and the Deployment's status, plus the processes themselves in /proc. One cluster serves the
module; each test has its namespace.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.support.waiting import wait_for
from vllm_localcluster.cluster import LocalCluster
from vllm_localcluster.node import container as container_module
from vllm_localcluster.node.container import (
    gpu_for_node_selector,
    loopback_of,
    pod_ip_of,
    pre_stop_delay,
    serve_args,
    termination_reason,
    with_pod_address,
)

T = TypeVar("T")

MODEL = "Qwen/Qwen2.5-7B-Instruct"
BACKOFF_SCALE = 10.0  # crash back-off 1 s, 2 s, 4 s ... instead of 10 s, 20 s, 40 s
SIM_ENV = {"VLLM_SIM_LOAD_TIME": "0.2", "VLLM_SIM_TIME_SCALE": "1"}


# ----------------------------------------------------------------------------- pure parts


def test_serve_args_accept_the_forms_vllm_is_started_with() -> None:
    rendered = serve_args(["vllm", "serve"], [MODEL, "--port", "8000"])
    assert rendered == [MODEL, "--port", "8000"]
    assert serve_args(["python3", "-m", "vllm.entrypoints.openai.api_server"], ["--model", MODEL])[
        :2
    ] == ["--model", MODEL]
    with pytest.raises(ValueError):
        serve_args(["nginx"], [])
    local = with_pod_address(
        [MODEL, "--port", "8000", "--host=0.0.0.0", "--max-num-seqs", "8"], "127.9.9.9", 1234
    )
    assert "8000" not in local and "--host=0.0.0.0" not in local
    assert local[-4:] == ["--host", "127.9.9.9", "--port", "1234"]
    assert local[local.index("--max-num-seqs") + 1] == "8"


def test_a_gpu_product_node_selector_picks_the_simulated_gpu() -> None:
    assert gpu_for_node_selector({"nvidia.com/gpu.product": "NVIDIA-H200"}) == "H200"
    assert gpu_for_node_selector({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}) == (
        "A100-80GB"
    )
    assert gpu_for_node_selector({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}) == (
        "A100-40GB"
    )
    assert gpu_for_node_selector({"kubernetes.io/os": "linux"}) is None
    assert gpu_for_node_selector(None) is None


def test_termination_reasons_follow_the_kubelet() -> None:
    assert termination_reason(137, "") == "OOMKilled"
    assert termination_reason(
        1, "torch.OutOfMemoryError: CUDA out of memory.\nEngineDeadError"
    ) == ("OOMKilled")
    startup = (
        "torch.OutOfMemoryError: CUDA out of memory.\n"
        "RuntimeError: Engine core initialization failed."
    )
    assert termination_reason(1, startup) == "Error"
    assert termination_reason(0, "") == "Completed"
    assert termination_reason(2, "usage: bad flag") == "Error"


def test_pre_stop_hooks_that_are_a_delay() -> None:
    assert pre_stop_delay({}) == 0.0
    assert pre_stop_delay({"lifecycle": {"preStop": {"sleep": {"seconds": 7}}}}) == 7.0
    assert pre_stop_delay({"lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}}}) == 5
    shell = {"exec": {"command": ["/bin/sh", "-c", "sleep 3"]}}
    assert pre_stop_delay({"lifecycle": {"preStop": shell}}) == 3.0
    other = {"httpGet": {"path": "/drain", "port": 8000}}
    assert pre_stop_delay({"lifecycle": {"preStop": other}}) is None


def test_pod_addresses_map_between_the_api_and_this_machine() -> None:
    assert pod_ip_of("127.200.3.4") == "10.200.3.4"
    assert loopback_of("10.200.3.4") == "127.200.3.4"
    assert with_pod_address(["M", "--port", "9000", "--host=0.0.0.0"], "127.1.2.3", 9000) == [
        "M", "--host", "127.1.2.3", "--port", "9000"
    ]  # fmt: skip


# ----------------------------------------------------------------------------- cluster


def process_running(pid: int) -> bool:
    """Alive and not a zombie (an exited child not yet reaped is not running)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Cluster:
    def __init__(self, local: LocalCluster, targets: list[Any]) -> None:
        self.local = local
        self.targets = targets
        self.namespaces: set[str] = set()

    def call(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        status, payload = self.local.request(method, path, body, **kw)
        assert status < 400, (status, payload)
        return payload

    def get(self, path: str) -> dict[str, Any] | None:
        status, payload = self.local.request("GET", path)
        if status == 404:
            return None
        assert status == 200, payload
        return dict(payload)

    def pods(self, namespace: str) -> list[dict[str, Any]]:
        return list(self.call("GET", f"/api/v1/namespaces/{namespace}/pods")["items"])

    def deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}")

    def create_deployment(self, namespace: str, body: dict[str, Any]) -> None:
        if namespace not in self.namespaces:
            self.call("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
            self.namespaces.add(namespace)
        self.call("POST", f"/apis/apps/v1/namespaces/{namespace}/deployments", body)

    def create_service(self, namespace: str, name: str) -> None:
        service = {
            "metadata": {"name": name},
            "spec": {"selector": {"app": name}, "ports": [{"port": 8000, "targetPort": 8000}]},
        }
        self.call("POST", f"/api/v1/namespaces/{namespace}/services", service)

    def patch_deployment(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.call(
            "PATCH",
            f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}",
            patch,
            content_type="application/strategic-merge-patch+json",
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("node-agent")
    targets: list[Any] = []
    local = LocalCluster(directory, with_prometheus=False, speed=BACKOFF_SCALE, sim_env=SIM_ENV)
    with local:
        assert local.agent is not None
        local.agent.config.on_targets = targets.append
        try:
            yield Cluster(local, targets)
        finally:
            pids = local.agent.pids()
    leaked = [pid for pid in pids if process_running(pid)]
    assert not leaked, f"processes left running: {leaked}"


def deployment(
    name: str, args: list[str], replicas: int = 1, env: dict[str, str] | None = None, **spec: Any
) -> dict[str, Any]:
    labels = {"app": name}
    container: dict[str, Any] = {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.11.0",
        "command": ["vllm", "serve"],
        "args": [MODEL, "--port", "8000", *args],
        "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 5},
    }
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    # Surge-free, as the operator renders it for full GPU nodes (the API's default is 25%/25%).
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "strategy": strategy,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [container], "terminationGracePeriodSeconds": 5},
            },
            **spec,
        },
    }


def container_status(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    return dict(statuses[0])


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def pid_of(pod: dict[str, Any]) -> int:
    return int(container_status(pod)["containerID"].removeprefix("local://"))


def url_of(pod: dict[str, Any]) -> str:
    """Where this machine reaches the pod: its pod IP 10.a.b.c listens at 127.a.b.c."""
    return f"http://{loopback_of(pod['status']['podIP'])}:8000"


def health(pod: dict[str, Any]) -> int:
    try:
        with urllib.request.urlopen(url_of(pod) + "/health", timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    for entry in (obj.get("status") or {}).get("conditions") or []:
        if entry["type"] == kind:
            return dict(entry)
    return {}


def until(
    predicate: Callable[[], T | None], timeout: float, message: str, interval: float = 0.05
) -> T:
    """`wait_for` for predicates that return the awaited object, or None while it is not there."""
    value = wait_for(predicate, timeout=timeout, interval=interval, message=message)
    assert value is not None
    return value


def deployment_where(
    cluster: Cluster, namespace: str, name: str, check: Callable[[dict[str, Any]], bool]
) -> Callable[[], dict[str, Any] | None]:
    def predicate() -> dict[str, Any] | None:
        found = cluster.deployment(namespace, name)
        return found if found is not None and check(found) else None

    return predicate


def ready_pods(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    return [p for p in cluster.pods(namespace) if is_ready(p)]


def test_deployment_becomes_a_ready_pod_with_a_process(cluster: Cluster) -> None:
    ns = "one"
    cluster.create_deployment(ns, deployment("llm", ["--max-num-seqs", "16"]))
    cluster.create_service(ns, "llm")
    pods = wait_for(lambda: ready_pods(cluster, ns), timeout=30, message="a ready pod")
    assert len(pods) == 1
    pod = pods[0]
    labels = pod["metadata"]["labels"]
    assert labels["app"] == "llm" and labels["pod-template-hash"]
    assert pod["metadata"]["name"].startswith(f"llm-{labels['pod-template-hash']}-")
    owner = pod["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "ReplicaSet" and owner["controller"] is True
    replicaset = cluster.get(f"/apis/apps/v1/namespaces/{ns}/replicasets/{owner['name']}")
    assert replicaset is not None
    assert replicaset["metadata"]["ownerReferences"][0]["name"] == "llm"
    assert pod["spec"]["nodeName"] == "localcluster"  # bound by kube-scheduler
    assert health(pod) == 200
    state = container_status(pod)
    assert state["ready"] is True and "running" in state["state"] and state["restartCount"] == 0
    assert pod["status"]["phase"] == "Running"
    assert process_running(pid_of(pod))

    def available() -> dict[str, Any] | None:
        dep = cluster.deployment(ns, "llm")
        status = (dep or {}).get("status") or {}
        return dep if status.get("availableReplicas") == 1 else None

    dep = until(available, timeout=10, message="deployment status")
    assert dep["status"]["observedGeneration"] == dep["metadata"]["generation"]
    assert condition(dep, "Available")["status"] == "True"
    assert condition(dep, "Progressing")["reason"] == "NewReplicaSetAvailable"
    endpoints = wait_for(lambda: cluster.local.endpoints(ns, "llm"), timeout=10, message="slice")
    assert endpoints == [(pod["metadata"]["name"], url_of(pod))]
    group = wait_for(
        lambda: [
            g
            for g in (cluster.targets[-1] if cluster.targets else [])
            if g["labels"]["namespace"] == ns
        ],
        timeout=5,
        message="a scrape target",
    )
    assert group == [
        {
            "targets": [url_of(pod).removeprefix("http://")],
            "labels": {
                "namespace": ns,
                "pod": pod["metadata"]["name"],
                "container": "vllm",
                "job": "vllm",
            },
        }
    ]


def test_surge_free_rolling_update_never_serves_from_two_revisions(cluster: Cluster) -> None:
    """maxSurge 0: the Deployment controller deletes the old pod before it creates the new
    one. As in Kubernetes, the replacement may start while the old pod still terminates (its
    process drains); what never happens is two pods that are ready and not terminating."""
    ns = "roll"
    cluster.create_deployment(ns, deployment("llm", ["--max-num-seqs", "16"]))
    old = wait_for(lambda: ready_pods(cluster, ns), timeout=30, message="first pod")[0]
    old_pid = pid_of(old)
    most_serving = [0]
    stop = threading.Event()

    def look() -> None:
        serving = [
            p
            for p in cluster.pods(ns)
            if is_ready(p) and not p["metadata"].get("deletionTimestamp")
        ]
        most_serving[0] = max(most_serving[0], len(serving))

    def observe() -> None:
        while not stop.is_set():
            look()
            stop.wait(0.02)

    look()  # the old pod serving, before the rollout (a loaded machine may start the thread late)
    watcher = threading.Thread(target=observe, daemon=True)
    watcher.start()
    try:
        template_args = [MODEL, "--port", "8000", "--max-num-seqs", "32"]
        cluster.patch_deployment(
            ns,
            "llm",
            {"spec": {"template": {"spec": {"containers": [
                {**deployment("llm", [])["spec"]["template"]["spec"]["containers"][0],
                 "args": template_args}
            ]}}}},
        )  # fmt: skip

        def rolled() -> dict[str, Any] | None:
            pods = cluster.pods(ns)
            ready = [p for p in pods if is_ready(p)]
            if len(pods) == 1 and ready and ready[0]["metadata"]["uid"] != old["metadata"]["uid"]:
                return ready[0]
            return None

        new = until(rolled, timeout=30, message="the new revision ready, the old one gone")
    finally:
        stop.set()
        watcher.join(5)
    look()  # and the new one, after it
    assert "--max-num-seqs" in new["spec"]["containers"][0]["args"]
    assert "32" in new["spec"]["containers"][0]["args"]
    assert (
        new["metadata"]["labels"]["pod-template-hash"]
        != old["metadata"]["labels"]["pod-template-hash"]
    )
    wait_for(lambda: not process_running(old_pid), timeout=10, message="old process gone")
    assert most_serving[0] == 1, f"{most_serving[0]} pods served at once"
    dep = until(
        deployment_where(
            cluster,
            ns,
            "llm",
            lambda d: (
                condition(d, "Progressing").get("reason") == "NewReplicaSetAvailable"
                and d["status"].get("updatedReplicas") == 1
            ),
        ),
        timeout=10,
        message="rollout complete in the deployment status",
    )
    assert dep["status"]["replicas"] == 1 and dep["status"]["availableReplicas"] == 1


def test_a_revision_that_cannot_start_crash_loops_while_the_old_one_serves(
    cluster: Cluster,
) -> None:
    ns = "crash"
    cluster.create_deployment(
        ns, deployment("llm", ["--max-num-seqs", "16"], replicas=2, progressDeadlineSeconds=3)
    )
    wait_for(lambda: len(ready_pods(cluster, ns)) == 2, timeout=40, message="two ready pods")
    # The model's weights do not fit in 5% of the GPU: vLLM refuses to start.
    bad = deployment("llm", ["--gpu-memory-utilization", "0.05"])["spec"]["template"]
    cluster.patch_deployment(ns, "llm", {"spec": {"template": bad}})

    def crash_looping() -> dict[str, Any] | None:
        for pod in cluster.pods(ns):
            state = container_status(pod)
            waiting = state.get("state", {}).get("waiting", {})
            if waiting.get("reason") == "CrashLoopBackOff" and state.get("restartCount", 0) >= 1:
                return pod
        return None

    pod = until(crash_looping, timeout=30, message="CrashLoopBackOff")
    last = container_status(pod)["lastState"]["terminated"]
    assert last["reason"] == "Error" and last["exitCode"] != 0
    assert "initialization failed" in last["message"]  # the last line vLLM printed
    serving = [p for p in ready_pods(cluster, ns) if p["metadata"]["uid"] != pod["metadata"]["uid"]]
    assert len(serving) == 1
    assert (
        serving[0]["metadata"]["labels"]["pod-template-hash"]
        != pod["metadata"]["labels"]["pod-template-hash"]
    )
    assert health(serving[0]) == 200
    dep = until(
        deployment_where(
            cluster,
            ns,
            "llm",
            lambda d: condition(d, "Progressing").get("reason") == "ProgressDeadlineExceeded",
        ),
        timeout=15,
        message="the progress deadline",
    )
    assert condition(dep, "Progressing")["status"] == "False"
    assert condition(dep, "Available")["status"] == "True"
    assert dep["status"]["availableReplicas"] == 1
    assert len(ready_pods(cluster, ns)) == 1


def test_a_run_time_oom_shows_as_oomkilled(cluster: Cluster) -> None:
    ns = "oom"
    env = {"VLLM_SIM_OOM_ABOVE_UTILIZATION": "0.5", "VLLM_SIM_OOM_MEAN_TIME": "0.001"}
    cluster.create_deployment(ns, deployment("llm", ["--gpu-memory-utilization", "0.9"], env=env))

    def oom_killed() -> dict[str, Any] | None:
        for pod in cluster.pods(ns):
            last = container_status(pod).get("lastState", {}).get("terminated")
            if last:
                return dict(last)
            if is_ready(pod):
                # An idle engine takes no steps; one request makes it allocate, and die.
                body = b'{"model": "%s", "prompt": "hi", "max_tokens": 4}' % MODEL.encode()
                request = urllib.request.Request(
                    url_of(pod) + "/v1/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                )
                with contextlib.suppress(urllib.error.URLError, OSError):
                    urllib.request.urlopen(request, timeout=2).close()
        return None

    last = until(oom_killed, timeout=30, interval=0.2, message="a terminated container")
    assert last["reason"] == "OOMKilled"


def test_scaling_and_deleting_a_pod_are_followed(cluster: Cluster) -> None:
    ns = "scale"
    cluster.create_deployment(ns, deployment("llm", []))
    first = until(lambda: ready_pods(cluster, ns) or None, timeout=30, message="a pod")[0]
    cluster.patch_deployment(ns, "llm", {"spec": {"replicas": 2}})
    until(lambda: len(ready_pods(cluster, ns)) == 2 or None, timeout=30, message="2 pods")
    # A pod deleted through the API loses its process and is replaced (ReplicaSet semantics).
    cluster.call("DELETE", f"/api/v1/namespaces/{ns}/pods/{first['metadata']['name']}")
    wait_for(lambda: not process_running(pid_of(first)), timeout=15, message="process gone")

    def replaced() -> list[dict[str, Any]] | None:
        pods = ready_pods(cluster, ns)
        names = {p["metadata"]["name"] for p in pods}
        return pods if len(pods) == 2 and first["metadata"]["name"] not in names else None

    until(replaced, timeout=30, message="a replacement pod")
    cluster.patch_deployment(ns, "llm", {"spec": {"replicas": 1}})
    until(lambda: len(cluster.pods(ns)) == 1 or None, timeout=15, message="scaled down")
    dep = until(
        deployment_where(cluster, ns, "llm", lambda d: d["status"].get("replicas") == 1),
        timeout=10,
        message="status replicas 1",
    )
    assert dep["status"]["availableReplicas"] == 1


def test_an_address_taken_by_someone_else_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.250.250.250", 8000))
        taken.listen()
        draws = iter([250, 250, 250, 200, 1, 2])
        monkeypatch.setattr(container_module.random, "randint", lambda a, b: next(draws))
        assert container_module.allocate_pod_ip(8000, set()) == "127.200.1.2"


def test_deleting_the_deployment_removes_pods_and_processes(cluster: Cluster) -> None:
    ns = "gone"
    cluster.create_deployment(ns, deployment("llm", [], replicas=2))
    cluster.create_service(ns, "llm")
    pods = until(
        lambda: p if len(p := ready_pods(cluster, ns)) == 2 else None, timeout=40, message="2"
    )
    pids = [pid_of(p) for p in pods]
    assert all(map(process_running, pids))
    cluster.call("DELETE", f"/apis/apps/v1/namespaces/{ns}/deployments/llm")
    wait_for(lambda: not cluster.pods(ns), timeout=15, message="pods deleted")
    wait_for(lambda: not any(map(process_running, pids)), timeout=15, message="processes gone")
    rs = cluster.call("GET", f"/apis/apps/v1/namespaces/{ns}/replicasets")["items"]
    assert rs == []
    wait_for(lambda: cluster.local.endpoints(ns, "llm") == [], timeout=5, message="no endpoints")
    assert os.path.exists(f"/proc/{os.getpid()}")  # /proc works here, so the checks above mean it
