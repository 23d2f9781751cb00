"""The node agent's env for a pod: the cluster's, the node's, a labelled fault's, the pod's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_localcluster.node.kubelet import Kubelet, KubeletConfig

CANARY = {"vllm.autotuner.io/track": "canary"}
SLOW = {"VLLM_SIM_BANDWIDTH_EFFICIENCY": "0.3"}


def pod(name: str, labels: dict[str, str], env: list[dict[str, str]] | None = None) -> Any:
    container: dict[str, Any] = {
        "name": "vllm",
        "command": ["vllm", "serve"],
        "args": ["meta-llama/Llama-3.1-8B-Instruct", "--port", "8000"],
    }
    if env:
        container["env"] = env
    return {
        "metadata": {"namespace": "default", "name": name, "uid": f"uid-{name}", "labels": labels},
        "spec": {"containers": [container], "nodeName": "localcluster"},
    }


def kubelet(tmp_path: Path) -> Kubelet:
    config = KubeletConfig(
        workdir=tmp_path,
        launcher=("vllm-sim",),
        env={"VLLM_SIM_TIME_SCALE": "5", "VLLM_SIM_BANDWIDTH_EFFICIENCY": "1.0"},
        env_by_labels=((CANARY, SLOW),),
    )
    return Kubelet(config, {"localcluster": {"VLLM_SIM_GPU": "H100"}})


def test_only_the_pods_with_the_labels_get_the_fault(tmp_path: Path) -> None:
    agent = kubelet(tmp_path)
    canary = agent.admit(pod("demo-canary-x", {"app": "demo", **CANARY}))
    stable = agent.admit(pod("demo-y", {"app": "demo"}))
    assert canary.env["VLLM_SIM_BANDWIDTH_EFFICIENCY"] == "0.3"
    assert stable.env["VLLM_SIM_BANDWIDTH_EFFICIENCY"] == "1.0"
    for c in (canary, stable):
        assert c.env["VLLM_SIM_TIME_SCALE"] == "5" and c.env["VLLM_SIM_GPU"] == "H100"


def test_the_pods_own_env_still_wins(tmp_path: Path) -> None:
    agent = kubelet(tmp_path)
    own = [{"name": "VLLM_SIM_BANDWIDTH_EFFICIENCY", "value": "0.9"}]
    canary = agent.admit(pod("demo-canary-z", {**CANARY}, env=own))
    assert canary.env["VLLM_SIM_BANDWIDTH_EFFICIENCY"] == "0.9"
