"""The fault-injection tests run against the API emulator, not the real API server.

They make the API fail on cue (409 conflicts, 500/503 bursts, slow answers, cut watches,
compaction, a write "kill switch" between two requests) and read back every stored version of
an object: things kube-apiserver cannot be made to do from outside. docs/decisions.md says why
this part of the emulator stays and what it costs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cluster_api import NS, Api
from vllm_autotuner.api.crds import render_crds
from vllm_localcluster.emulator import EmulatorServer


@pytest.fixture
def emulator() -> Iterator[EmulatorServer]:
    """The API emulator with our CRDs, on a free loopback port, stopped after the test."""
    server = EmulatorServer(host="127.0.0.1", port=0)
    for crd in render_crds():
        server.emulator.register_crd(crd)
    server.start_in_thread()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def api(emulator: EmulatorServer) -> Api:
    api = Api(emulator.url)
    api.create(
        "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    )
    return api
