"""Fixtures shared by every test package."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.support.cluster_api import api, apiserver
from tests.support.prometheus import running_prometheus
from vllm_localcluster.prometheus import PrometheusServer

# Property tests explore the same examples on every run unless told otherwise, so that CI's
# verdict is reproducible; `HYPOTHESIS_PROFILE=explore` draws new ones (and finds new failures,
# which then belong in a test of their own).
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The real API server (one per session) and a per-test client that cleans up after the test.
__all__ = ["api", "apiserver"]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[PrometheusServer]:
    """A real Prometheus on a free 127.0.0.1 port scraping every 1 s; no targets until the test
    calls `set_targets`. Stopped after the test."""
    with running_prometheus(tmp_path / "prometheus") as server:
        yield server
