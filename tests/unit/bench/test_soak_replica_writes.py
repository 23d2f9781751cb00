"""The soak's classifier of the operator's writes to a replica count an autoscaler owns: the
number it counts is issue 18's goal (0), so it must see every such write and nothing else."""

from __future__ import annotations

import json

import pytest
from bench.soak.run import SoakConfig, scale_target, writes_owned_replicas

from vllm_localcluster.faults import RequestRecord, parse_request

DEPLOYMENTS = "/apis/apps/v1/namespaces/soak/deployments"
VLLM = "/apis/vllm.autotuner.io/v1alpha1/namespaces/soak/vllmdeployments"
AGENT = {"User-Agent": "vllm-autotuner/0.1", "Content-Type": "application/apply-patch+yaml"}


def record(method: str, path: str, body: object = None) -> RequestRecord:
    raw = b"" if body is None else json.dumps(body).encode()
    return parse_request(method, path, "fieldManager=vllm-autotuner", AGENT, raw)


@pytest.mark.parametrize(
    ("method", "path", "body", "target", "expected"),
    [
        # Target Deployment: an apply with spec.replicas, or /scale, takes the count.
        ("PATCH", f"{DEPLOYMENTS}/llm-0", {"spec": {"replicas": 2}}, "Deployment", True),
        ("PUT", f"{DEPLOYMENTS}/llm-0/scale", {"spec": {"replicas": 1}}, "Deployment", True),
        ("PATCH", f"{DEPLOYMENTS}/llm-0", {"spec": {"template": {}}}, "Deployment", False),
        # Another object of the same kind, a read, a JSON patch list: not the count.
        ("PATCH", f"{DEPLOYMENTS}/llm-0-canary", {"spec": {"replicas": 1}}, "Deployment", False),
        ("GET", f"{DEPLOYMENTS}/llm-0/scale", None, "Deployment", False),
        # Target VLLMDeployment: only its status is the operator's.
        ("PATCH", f"{VLLM}/llm-0", {"spec": {"replicas": 3}}, "VLLMDeployment", True),
        ("PUT", f"{VLLM}/llm-0/scale", {"spec": {"replicas": 3}}, "VLLMDeployment", True),
        ("PATCH", f"{VLLM}/llm-0/status", {"status": {"replicas": 3}}, "VLLMDeployment", False),
        ("PATCH", f"{VLLM}/llm-0", {"metadata": {"finalizers": []}}, "VLLMDeployment", False),
        # Under target VLLMDeployment the operator carries the count to its Deployment.
        ("PATCH", f"{DEPLOYMENTS}/llm-0", {"spec": {"replicas": 2}}, "VLLMDeployment", False),
    ],
)
def test_writes_owned_replicas(
    method: str, path: str, body: object, target: str, expected: bool
) -> None:
    assert writes_owned_replicas(record(method, path, body), "llm-0", target) is expected


def test_autoscaled_soak_deployments_alternate_targets() -> None:
    config = SoakConfig(autoscaler=True)
    targets = [config.deployment(i)["spec"]["autoscaling"]["target"] for i in range(4)]
    assert (
        targets
        == [scale_target(i) for i in range(4)]
        == [
            "Deployment",
            "VLLMDeployment",
            "Deployment",
            "VLLMDeployment",
        ]
    )
    assert "autoscaling" not in SoakConfig().deployment(0)["spec"]
