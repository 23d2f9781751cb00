"""Hostile tenants against the real kopf operator and the real API server (issue classes 1, 2, 7).

Class 1: the fault proxy between the operator and kube-apiserver turns every watch event about
one object into a line cut short (as a proxy that dropped the connection mid-line would leave
it); the operator must log it, skip it, and go on reconciling every other tenant. And a fresh
operator process must decode the deepest object the API server can serve at all. Classes 2
and 7: a stranger's Service under the child's name, and a stranger's pod with the child's
labels, change nothing that is theirs or ours.
"""

from __future__ import annotations

import copy
import logging
import subprocess
import sys

import pytest

from tests.support.cluster_api import (
    CR,
    CR_PATH,
    DEPLOYMENT_PATH,
    NS,
    POLICY,
    POLICY_PATH,
    SERVICE_PATH,
    Api,
    ApiServer,
)
from tests.support.fake_fleet import FakeKubelet, SyntheticSnapshots
from tests.support.faults import (
    START,
    WRITE_VERBS,
    cond,
    cond_when,
    cr_with_mode,
    fast_policy,
    operator,
    operator_config,
    proxy,
)
from tests.support.operator_runner import running_operator
from tests.support.waiting import wait_for
from vllm_autotuner.core.render import KNOBS_ANNOTATION, knob_label
from vllm_localcluster.faults import FaultProxy, event_named

__all__ = ["proxy"]  # the fixture

POISON = "poison"


def test_an_undecodable_watch_event_is_skipped_and_other_tenants_are_reconciled(
    proxy: FaultProxy, api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="vllm_autotuner")
    garbled = proxy.corrupt_watch_events("vllmdeployments", event_named(POISON))
    api.create(POLICY_PATH, POLICY)
    with operator(operator_config(proxy, interval_s=1.0)) as running:
        wait_for(
            lambda: (api.get(f"{POLICY_PATH}/default") or {}).get("status"),
            20,
            message="the operator to publish the policy's status (it watches)",
        )
        poison = copy.deepcopy(CR)
        poison["metadata"]["name"] = POISON
        api.create(CR_PATH, poison)
        api.create(CR_PATH, copy.deepcopy(CR))
        wait_for(
            lambda: api.get(f"{DEPLOYMENT_PATH}/llama"),
            20,
            message="the other tenant's Deployment, created after the undecodable event",
        )
        # The poison's event came first on the same stream: it reached the operator garbled.
        assert garbled.hits >= 1
        assert running._thread.is_alive(), running.error
        assert running.error is None
    assert "skipped a watch event that cannot be decoded" in caplog.text


DECODE = """
import json, sys
from vllm_autotuner.operator import API_SERVER_MAX_JSON_DEPTH, allow_api_server_depth
allow_api_server_depth()
depth = API_SERVER_MAX_JSON_DEPTH
for text in ('{"a":' * depth + '1' + '}' * depth, '[' * depth + ']' * depth):
    event = json.loads('{"type":"ADDED","object":{"spec":' + text + '}}')
    assert event["type"] == "ADDED"
print("decoded")
"""


def test_the_operator_decodes_the_deepest_object_the_api_server_can_serve() -> None:
    """kube-apiserver's JSON decoder stops at 10000 levels; below that the operator decodes."""
    done = subprocess.run(
        [sys.executable, "-c", DECODE], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "decoded"


# ------------------------------------------------------------------ class 7: pods by ownership


def test_a_crash_looping_pod_that_only_copies_the_labels_degrades_nothing(
    apiserver: ApiServer, api: Api
) -> None:
    """A stranger's pod with every label and the knobs annotation of the deployment's pods,
    crash-looping from the start: the real operator must not count it."""
    labels = {
        "vllm.autotuner.io/deployment": "llama",
        "app.kubernetes.io/managed-by": "vllm-autotuner",
        "app.kubernetes.io/name": "vllm",
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "llama-copycat",
            "labels": labels,
            "annotations": {KNOBS_ANNOTATION: knob_label(START)},
        },
        "spec": {"containers": [{"name": "vllm", "image": "busybox"}]},
    }
    api.create(f"/api/v1/namespaces/{NS}/pods", pod)
    api.merge(
        f"/api/v1/namespaces/{NS}/pods/llama-copycat/status",
        {
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "False"}],
                "containerStatuses": [
                    {
                        "name": "vllm",
                        "image": "busybox",
                        "imageID": "",
                        "ready": False,
                        "restartCount": 9,
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    }
                ],
            }
        },
    )
    api.create(POLICY_PATH, fast_policy())
    api.create(CR_PATH, cr_with_mode("Recommend"))
    with (
        FakeKubelet(apiserver, NS),
        running_operator(
            apiserver.operator_credentials(), interval_s=0.5, snapshot_source=SyntheticSnapshots()
        ),
    ):
        wait_for(cond_when(api, "Ready", "True"), 30, message="the deployment to be Ready")
        degraded = cond(api, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("False", "AsExpected"), degraded
    copycat = api.get(f"/api/v1/namespaces/{NS}/pods/llama-copycat") or {}
    assert copycat["status"]["containerStatuses"][0]["restartCount"] == 9  # still crash-looping


# ------------------------------------------------------------------ class 2: name collisions


def test_a_foreign_service_under_the_childs_name_is_left_untouched(
    apiserver: ApiServer, api: Api
) -> None:
    foreign = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "llama", "labels": {"owner": "someone-else"}},
        "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 5432}]},
    }
    api.create(SERVICE_PATH, foreign)
    api.create(POLICY_PATH, fast_policy())
    api.create(CR_PATH, cr_with_mode("Off"))
    with running_operator(apiserver.operator_credentials(), interval_s=0.5):
        wait_for(
            cond_when(api, "Degraded", "True", "already exists"),
            20,
            message="a NameConflict condition",
        )
    service = api.get(f"{SERVICE_PATH}/llama") or {}
    assert "ownerReferences" not in service["metadata"], service["metadata"]
    assert service["spec"]["selector"] == {"app": "theirs"}
    assert [p["port"] for p in service["spec"]["ports"]] == [5432]
    assert api.get(f"{DEPLOYMENT_PATH}/llama") is None
    assert cond(api, "Degraded")["reason"] == "NameConflict"
    # The API server's audit log: the operator never wrote to the stranger's Service.
    writes = [
        (r.verb, r.status_code)
        for r in apiserver.requests_by("vllm-autotuner")
        if r.resource == "services" and r.name == "llama" and r.verb in WRITE_VERBS
    ]
    assert writes == [], writes
