"""The demo's embedded objects are the ones in examples/, and both are valid."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.support.crd_validation import validate
from vllm_autotuner.api.crds import deployment_crd, policy_crd
from vllm_localcluster.demo import DEMO_DEPLOYMENT, DEMO_POLICY

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def test_examples_match_the_embedded_demo_objects() -> None:
    assert yaml.safe_load((EXAMPLES / "demo-policy.yaml").read_text()) == DEMO_POLICY
    assert yaml.safe_load((EXAMPLES / "demo-deployment.yaml").read_text()) == DEMO_DEPLOYMENT


def test_demo_objects_pass_the_crd_schemas_and_cel_rules() -> None:
    assert validate(policy_crd(), DEMO_POLICY) == []
    assert validate(deployment_crd(), DEMO_DEPLOYMENT) == []
