"""The real kopf operator against the real API server: deploy, update, delete, never write
spec."""

from __future__ import annotations

import copy
from typing import Any

from tests.support.cluster_api import (
    CR,
    CR_PATH,
    DEPLOYMENT_PATH,
    POLICY,
    POLICY_PATH,
    SERVICE_PATH,
    Api,
    ApiServer,
    args_of,
    condition,
)
from tests.support.operator_runner import running_operator
from tests.support.waiting import wait_for
from vllm_autotuner import GROUP

FINALIZER = f"{GROUP}/finalizer"  # what kopf put on every VLLMDeployment while timers ran


def test_create_update_delete_lifecycle(apiserver: ApiServer, api: Api) -> None:
    api.create(POLICY_PATH, POLICY)
    cr = api.create(CR_PATH, copy.deepcopy(CR))
    with running_operator(apiserver.operator_credentials(), interval_s=1.0):
        deployment = wait_for(lambda: api.get(f"{DEPLOYMENT_PATH}/llama"), 20, message="Deployment")
        args = args_of(deployment)
        assert args[:3] == ["meta-llama/Llama-3.1-8B-Instruct", "--port", "8000"]
        # H100 tier default for the token budget, the pinned max_num_seqs, vLLM's utilisation.
        assert args[args.index("--max-num-batched-tokens") + 1] == "8192"
        assert args[args.index("--max-num-seqs") + 1] == "256"
        assert args[args.index("--gpu-memory-utilization") + 1] == "0.92"
        (ref,) = deployment["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"]) == (
            "VLLMDeployment",
            "llama",
            cr["metadata"]["uid"],
        )
        assert ref["controller"] is True
        template_meta = deployment["spec"]["template"]["metadata"]
        assert "app.kubernetes.io/instance" not in deployment["metadata"]["labels"]
        assert "app.kubernetes.io/instance" not in template_meta["labels"]
        assert not any(k.startswith("argocd.argoproj.io/") for k in template_meta["annotations"])
        service = wait_for(lambda: api.get(f"{SERVICE_PATH}/llama"), 10, message="Service")
        assert service["spec"]["ports"][0]["port"] == 8000

        # Status: generation observed, policy resolved, not Ready until pods are available.
        def observed(gen: int) -> dict[str, Any] | None:
            obj = api.get(f"{CR_PATH}/llama")
            ok = obj and (obj.get("status") or {}).get("observedGeneration") == gen
            return obj if ok else None

        obj = wait_for(lambda: observed(1), 10, message="observedGeneration 1")
        assert condition(obj, "PolicyResolved")["status"] == "True"  # type: ignore[index]
        assert condition(obj, "Ready")["status"] == "False"  # type: ignore[index]
        assert obj["status"]["tuning"]["applied"]["maxNumSeqs"] == 256

        # The Deployment becomes available (what the kubelet and controller would report).
        api.merge(
            f"{DEPLOYMENT_PATH}/llama/status",
            {
                "status": {
                    "observedGeneration": deployment["metadata"]["generation"],
                    "replicas": 1,
                    "readyReplicas": 1,
                    "updatedReplicas": 1,
                    "availableReplicas": 1,
                    "conditions": [
                        {
                            "type": "Available",
                            "status": "True",
                            "reason": "MinimumReplicasAvailable",
                        }
                    ],
                }
            },
        )
        wait_for(
            lambda: (condition(api.get(f"{CR_PATH}/llama"), "Ready") or {}).get("status") == "True",
            15,
            message="Ready=True",
        )

        # An update to the spec reaches the Deployment and bumps observedGeneration.
        api.merge(f"{CR_PATH}/llama", {"spec": {"replicas": 2, "engine": {"maxModelLen": 8192}}})
        updated = wait_for(
            lambda: (d := api.get(f"{DEPLOYMENT_PATH}/llama")) and d["spec"]["replicas"] == 2 and d,
            15,
            message="Deployment updated",
        )
        assert "--max-model-len" in args_of(updated)
        wait_for(lambda: observed(2), 10, message="observedGeneration 2")

        # The operator kept its hands off what lives in Git: spec, labels, annotations.
        live = api.get(f"{CR_PATH}/llama") or {}
        assert live["spec"]["knobs"] == {"maxNumSeqs": 256}
        assert live["spec"]["replicas"] == 2
        assert live["metadata"]["labels"] == CR["metadata"]["labels"]
        assert live["metadata"]["annotations"] == CR["metadata"]["annotations"]

        # Deleting the CR removes its children through their owner references.
        api.delete(f"{CR_PATH}/llama")
        wait_for(lambda: api.get(f"{CR_PATH}/llama") is None, 20, message="CR gone")
        wait_for(lambda: api.get(f"{DEPLOYMENT_PATH}/llama") is None, 10, message="Deployment gone")
        wait_for(lambda: api.get(f"{SERVICE_PATH}/llama") is None, 10, message="Service gone")

    # From the API server's audit log: the operator never wrote the CR's spec.
    writes = [
        r
        for r in apiserver.requests_by("vllm-autotuner")
        if r.resource == "vllmdeployments" and r.verb in ("update", "patch", "create")
    ]
    assert writes, "the operator should have written status"
    for record in writes:
        if record.subresource == "status":
            continue
        body = record.body if isinstance(record.body, dict) else {}
        assert "spec" not in body, f"operator wrote spec: {record}"


def test_missing_policy_gives_a_condition_and_deploys_nothing(
    apiserver: ApiServer, api: Api
) -> None:
    cr = copy.deepcopy(CR)
    cr["spec"]["tuning"] = {"mode": "Auto", "policyRef": "nope"}
    api.create(CR_PATH, cr)
    with running_operator(apiserver.operator_credentials(), interval_s=1.0):
        obj = wait_for(
            lambda: (o := api.get(f"{CR_PATH}/llama")) and condition(o, "PolicyResolved") and o,
            15,
            message="PolicyResolved condition",
        )
        policy_cond = condition(obj, "PolicyResolved")
        assert policy_cond is not None
        assert (policy_cond["status"], policy_cond["reason"]) == ("False", "PolicyNotFound")
        assert "'nope'" in policy_cond["message"]
        assert (condition(obj, "Degraded") or {}).get("status") == "True"
        assert api.get(f"{DEPLOYMENT_PATH}/llama") is None

        # Creating the policy lets the next reconcile deploy.
        api.create(POLICY_PATH, {**POLICY, "metadata": {"name": "nope"}})
        wait_for(lambda: api.get(f"{DEPLOYMENT_PATH}/llama"), 15, message="Deployment after policy")
        wait_for(
            lambda: (
                (condition(api.get(f"{CR_PATH}/llama"), "PolicyResolved") or {}).get("status")
                == "True"
            ),
            10,
            message="PolicyResolved=True",
        )


def test_hand_edited_deployment_is_restored(apiserver: ApiServer, api: Api) -> None:
    api.create(POLICY_PATH, POLICY)
    api.create(CR_PATH, copy.deepcopy(CR))
    with running_operator(apiserver.operator_credentials(), interval_s=1.0):
        deployment = wait_for(lambda: api.get(f"{DEPLOYMENT_PATH}/llama"), 20, message="Deployment")
        original = args_of(deployment)
        value = original.index("--gpu-memory-utilization") + 1
        assert original[value] != "0.5"
        edited = [*original[:value], "0.5", *original[value + 1 :]]
        api.merge(
            f"{DEPLOYMENT_PATH}/llama",
            {"spec": {"template": {"spec": {"containers": [{"name": "vllm", "args": edited}]}}}},
            strategic=True,
        )
        wait_for(
            lambda: args_of(api.get(f"{DEPLOYMENT_PATH}/llama") or deployment) == original,
            15,
            message="args restored",
        )


def test_standalone_operator_leaves_no_finalizer_so_deletion_never_waits_for_it(
    apiserver: ApiServer, api: Api
) -> None:
    """One periodic loop instead of kopf timers (periodic.py): kopf only puts its finalizer on
    objects with timers, so a VLLMDeployment can be deleted while the operator is down; one
    that still carries the finalizer of an earlier version is released."""
    api.create(POLICY_PATH, POLICY)
    api.create(CR_PATH, copy.deepcopy(CR))
    old = copy.deepcopy(CR)
    old["metadata"] = {**old["metadata"], "name": "older", "finalizers": [FINALIZER]}
    api.create(CR_PATH, old)
    with running_operator(apiserver.operator_credentials(), interval_s=1.0):
        for name in ("llama", "older"):
            wait_for(
                lambda n=name: api.get(f"{DEPLOYMENT_PATH}/{n}"), 20, message=f"{name} deployed"
            )
        wait_for(
            lambda: not (api.get(f"{CR_PATH}/older") or {})["metadata"].get("finalizers"),
            20,
            message="the earlier version's finalizer released",
        )
        assert not (api.get(f"{CR_PATH}/llama") or {})["metadata"].get("finalizers")
    # The operator is stopped: deletion completes at once.
    api.delete(f"{CR_PATH}/llama")
    wait_for(lambda: api.get(f"{CR_PATH}/llama") is None, 5, message="CR deleted without operator")
