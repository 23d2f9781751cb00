"""Shared fixtures: the generated CRDs and the example objects, loaded once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_autotuner.api.crds import render_crds

REPO_ROOT = Path(__file__).resolve().parents[3]
EXAMPLES_DIR = REPO_ROOT / "examples"


def example_documents() -> list[tuple[str, dict[str, Any]]]:
    """(file:index, document) for every YAML document under examples/."""
    out = []
    for path in sorted(EXAMPLES_DIR.glob("*.yaml")):
        with path.open(encoding="utf-8") as handle:
            for i, doc in enumerate(yaml.safe_load_all(handle)):
                if doc is not None:
                    out.append((f"{path.name}:{i}", doc))
    return out


@pytest.fixture(scope="session")
def crds_by_kind() -> dict[str, dict[str, Any]]:
    return {crd["spec"]["names"]["kind"]: crd for crd in render_crds()}
