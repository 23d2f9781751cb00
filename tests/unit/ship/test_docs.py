"""The operations docs stay true: the metrics table matches what the operator exports, and
cross-references resolve (the alerts are tested in test_monitoring.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_autotuner.adapters.metrics import OperatorMetrics

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
OWN_DOCS = ("gitops.md", "operations.md", "troubleshooting.md")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Prometheus) not installed")


def yaml_blocks(markdown: str) -> list[Any]:
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", markdown, re.DOTALL)]


def exported_metric_names() -> set[str]:
    """Sample names as Prometheus stores them (counters get `_total`)."""
    names = set()
    for family in OperatorMetrics().registry.collect():
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def test_metrics_table_lists_exactly_what_the_operator_exports() -> None:
    text = (DOCS / "operations.md").read_text()
    documented = set(re.findall(r"^\| `(vllm_autotuner_\w+)` \|", text, re.MULTILINE))
    assert documented == exported_metric_names()


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


@pytest.mark.parametrize("doc", OWN_DOCS)
def test_links_between_docs_resolve(doc: str) -> None:
    text = (DOCS / doc).read_text()
    for target, anchor in re.findall(r"\]\(([\w.-]+\.md)(?:#([\w-]+))?\)", text):
        path = DOCS / target
        assert path.exists(), f"{doc} links to missing {target}"
        if anchor:
            assert anchor in heading_anchors(path.read_text()), f"{doc}: {target}#{anchor}"


@pytest.mark.parametrize("doc", OWN_DOCS)
def test_files_the_docs_point_to_exist(doc: str) -> None:
    text = (DOCS / doc).read_text()
    for path in re.findall(r"\b((?:examples|charts|argocd|crds)/[\w./-]+\.(?:yaml|lua))", text):
        assert (ROOT / path).exists(), f"{doc} mentions missing {path}"
    for block in yaml_blocks(text):
        assert block is not None


def test_troubleshooting_covers_the_known_symptoms() -> None:
    headings = {
        h.lower()
        for h in re.findall(r"^## (.+)$", (DOCS / "troubleshooting.md").read_text(), re.MULTILINE)
    }
    for symptom in ("progressing", "metricsavailable", "degraded", "pending", "vllm_", "deleted"):
        assert any(symptom in h for h in headings), symptom


_OUTSIDE = re.compile(
    r"\bshared/|\breference/\S+\.md|\b(vllm|peers|kubernetes-conventions|testing-infrastructure"
    r"|simulator-calibration|real-vllm-measurements(-2)?|design)\.md\b"
)


def test_nothing_cites_files_outside_the_repository() -> None:
    """Users have the repository only: facts carry their public source, not a private note."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    offenders = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in (".py", ".md", ".yaml", ".yml", ".toml", ".json", ".tpl", ".txt"):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _OUTSIDE.search(line):
                offenders.append(f"{name}:{number}: {line.strip()[:80]}")
    assert offenders == []
