"""The fault-injection tests: the real API server with a fault-injecting proxy in front of it.

The operator under test talks to the proxy (vllm_localcluster.faults.FaultProxy), which makes
chosen requests fail on cue (409 conflicts, 500/503 bursts, slow answers, cut watches, the
410 Gone of a compacted history) and records every request; the test itself, and the fake
kubelet, talk to the API server directly.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cluster_api import ApiServer
from vllm_localcluster.faults import FaultProxy


@pytest.fixture
def proxy(apiserver: ApiServer) -> Iterator[FaultProxy]:
    """A proxy to the session's API server; clients without credentials act as the operator."""
    token = apiserver.operator_token
    proxy = FaultProxy(apiserver.url, str(apiserver.ca_file), token=token).start_in_thread()
    try:
        yield proxy
    finally:
        proxy.stop()
