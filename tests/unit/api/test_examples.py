"""Every example is accepted by the CRD schema, its CEL rules and the pydantic model, and the
API server's defaults agree with pydantic's."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from tests.support.crd_validation import apply_defaults, crd_schema, validate
from tests.unit.api.conftest import example_documents
from vllm_autotuner.api import VLLMDeployment, VLLMTuningPolicy

MODELS: dict[str, type[BaseModel]] = {
    "VLLMDeployment": VLLMDeployment,
    "VLLMTuningPolicy": VLLMTuningPolicy,
}
EXAMPLES = example_documents()


def test_examples_cover_both_kinds_and_the_demo() -> None:
    names = {name.split(":")[0] for name, _ in EXAMPLES}
    assert {"policy-default.yaml", "llama-3.1-8b-h100.yaml", "llama-3.1-70b-tp4-h200.yaml"} <= names
    assert {"demo-policy.yaml", "demo-deployment.yaml"} <= names
    assert {doc["kind"] for _, doc in EXAMPLES} == set(MODELS)


@pytest.mark.parametrize(("name", "doc"), EXAMPLES, ids=[n for n, _ in EXAMPLES])
def test_example_is_accepted_by_crd(
    name: str, doc: dict[str, Any], crds_by_kind: dict[str, dict[str, Any]]
) -> None:
    assert [str(v) for v in validate(crds_by_kind[doc["kind"]], doc)] == []


@pytest.mark.parametrize(("name", "doc"), EXAMPLES, ids=[n for n, _ in EXAMPLES])
def test_example_is_accepted_by_model(name: str, doc: dict[str, Any]) -> None:
    obj = MODELS[doc["kind"]].model_validate(doc)
    assert obj.model_dump(by_alias=True, exclude_none=True)["spec"]


@pytest.mark.parametrize(("name", "doc"), EXAMPLES, ids=[n for n, _ in EXAMPLES])
def test_schema_defaults_match_model_defaults(
    name: str, doc: dict[str, Any], crds_by_kind: dict[str, dict[str, Any]]
) -> None:
    """What kubectl shows after apply (server defaults) parses to what the operator assumes."""
    model = MODELS[doc["kind"]]
    server_side = apply_defaults(crd_schema(crds_by_kind[doc["kind"]]), doc)
    assert model.model_validate(server_side) == model.model_validate(doc)
    # and every value pydantic fills in is also filled in by the API server
    filled = model.model_validate(doc).model_dump(by_alias=True, exclude_none=True, mode="json")
    assert _drop_empty(filled["spec"]) == _drop_empty(server_side["spec"])


def _drop_empty(value: Any) -> Any:
    """Empty lists/maps are absent on the server and present in pydantic; both mean 'none'."""
    if isinstance(value, dict):
        kept = {k: _drop_empty(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in ({}, [])}
    if isinstance(value, list):
        return [_drop_empty(v) for v in value]
    return value
