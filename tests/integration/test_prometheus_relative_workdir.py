"""A relative work directory still gives a Prometheus that scrapes its file-discovered targets.

Prometheus resolves relative `file_sd_configs` paths against its config file's directory, not
the caller's working directory; `make demo` writes under a relative `demo-report/`, so the
launcher must hand Prometheus absolute paths.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.prometheus import target_group, wait_for_query
from vllm_localcluster.prometheus import PrometheusServer


def test_relative_workdir_scrapes_file_discovered_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    server = PrometheusServer("relative/prometheus")
    try:
        server.start()
        assert server.workdir.is_absolute()
        address = server.url.removeprefix("http://")
        server.set_targets([target_group(address, namespace="ns", pod="self", job="self")])
        wait_for_query(server, 'up{job="self", pod="self"} == 1', timeout=30)
    finally:
        server.stop()
    assert os.path.isdir(tmp_path / "relative" / "prometheus")
