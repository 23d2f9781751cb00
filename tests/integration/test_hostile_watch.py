"""Class 1 at run time: a watch event the operator cannot decode never stops it.

The real kopf operator runs against the API emulator. The emulator is made to send one watch
event that is not valid JSON (a proxy that cut a line, or an object deeper than any decoder
allows); the operator must log it, skip it, and go on reconciling every other tenant. And a
fresh operator process must decode the deepest object the API server can serve at all.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from tests.support.cluster_api import CR, CR_PATH, DEPLOYMENT_PATH, POLICY, POLICY_PATH, Api
from tests.support.operator_runner import running_operator
from tests.support.waiting import wait_for
from vllm_autotuner.local.emulator import EmulatorServer, handler

POISON = "poison"


@pytest.fixture
def garbling_emulator(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every watch event about the object named POISON reaches the client as a cut-off line."""
    original = handler._write_event

    async def write(response: Any, event: Mapping[str, Any]) -> None:
        if ((event.get("object") or {}).get("metadata") or {}).get("name") == POISON:
            await response.write(b'{"type":"ADDED","object":{"metadata":{"name":"poi\n')
            return
        await original(response, event)

    monkeypatch.setattr(handler, "_write_event", write)
    yield


def test_an_undecodable_watch_event_is_skipped_and_other_tenants_are_reconciled(
    garbling_emulator: None, emulator: EmulatorServer, api: Api
) -> None:
    api.create(POLICY_PATH, POLICY)
    with running_operator(emulator.url, interval_s=1.0) as operator:
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
        assert operator._thread.is_alive(), operator.error
        assert operator.error is None


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
