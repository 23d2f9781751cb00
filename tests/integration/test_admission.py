"""The CRDs as kube-apiserver enforces them: every invalid object of the table in
tests/unit/api/test_invalid.py is sent to the real API server, and every example to apply.

The unit tests judge the same objects with jsonschema and celpy (tests/support/crd_validation),
which run without a server; here the server itself answers, so a difference between the two
(celpy's CEL is not the API server's: durations, string functions, cost limits) shows up as a
failure here. Objects go in with `fieldValidation=Strict`, as kubectl sends them: an unknown
field is refused, not silently pruned.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.support.cluster_api import NS, Api
from tests.support.crd_validation import validate
from tests.unit.api.conftest import example_documents
from tests.unit.api.test_invalid import CASES, Case, changed
from vllm_autotuner.api.crds import render_crds

GROUP = "/apis/vllm.autotuner.io/v1alpha1"
CRDS = {crd["spec"]["names"]["kind"]: crd for crd in render_crds()}


def path_for(obj: dict[str, Any]) -> str:
    if obj["kind"] == "VLLMTuningPolicy":
        return f"{GROUP}/vllmtuningpolicies"
    return f"{GROUP}/namespaces/{NS}/vllmdeployments"


def submit(api: Api, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Create `obj` as kubectl would (strict field validation); (status, answer)."""
    body = copy.deepcopy(obj)
    body["metadata"] = {**body.get("metadata", {}), "namespace": NS}
    if obj["kind"] == "VLLMTuningPolicy":
        body["metadata"].pop("namespace")
    r = api.session.post(f"{api.url}{path_for(obj)}?fieldValidation=Strict", json=body, timeout=10)
    return r.status_code, dict(r.json())


def causes(answer: dict[str, Any]) -> list[str]:
    details = answer.get("details") or {}
    found = [f"{c.get('field', '')}: {c.get('message', '')}" for c in details.get("causes") or []]
    return found or [str(answer.get("message", ""))]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_api_server_refuses_what_the_offline_validator_refuses(case: Case, api: Api) -> None:
    obj = changed(case.base, case.changes)
    offline = validate(CRDS[obj["kind"]], obj)
    assert offline, "the offline validator accepts an object the table calls invalid"
    status, answer = submit(api, obj)
    messages = causes(answer)
    # 422 Invalid; an unknown field under strict validation is a 400 BadRequest (the decoder
    # refuses it before validation runs).
    unknown_field = status == 400 and "unknown field" in str(answer.get("message"))
    assert status == 422 or unknown_field, (status, answer)
    if case.cel is not None:
        # The rule's own message, as both CEL implementations must produce it.
        assert any(case.cel in m for m in messages), messages
    else:
        # Schema errors are worded differently by jsonschema and the API server; the field
        # must be the same, or the server names a parent of it.
        field = case.changes[0][0].split(".")[-1]
        assert any(field in m or ".spec" in m or "spec." in m for m in messages), messages


@pytest.mark.parametrize(
    "document",
    [doc for _, doc in example_documents() if doc.get("kind") in CRDS],
    ids=[name for name, doc in example_documents() if doc.get("kind") in CRDS],
)
def test_every_example_is_admitted_as_the_offline_validator_admits_it(
    document: dict[str, Any], api: Api
) -> None:
    assert validate(CRDS[document["kind"]], document) == []
    status, answer = submit(api, document)
    assert status == 201, (status, answer)
    # Defaults are applied by the server as the CRD declares them; nothing is pruned.
    assert answer["spec"].keys() >= document["spec"].keys()
