"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster_api import api, apiserver
from tests.support.prometheus import running_prometheus
from vllm_localcluster.prometheus import PrometheusServer

# The real API server (one per session) and a per-test client that cleans up after the test.
__all__ = ["api", "apiserver"]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[PrometheusServer]:
    """A real Prometheus on a free 127.0.0.1 port scraping every 1 s; no targets until the test
    calls `set_targets`. Stopped after the test."""
    with running_prometheus(tmp_path / "prometheus") as server:
        yield server
