"""The fault-injection tests: the real API server with a fault-injecting proxy in front of it.

The operator under test talks to the proxy (vllm_localcluster.faults.FaultProxy), which makes
chosen requests fail on cue (409 conflicts, 500/503 bursts, slow answers, cut watches, the
410 Gone of a compacted history) and records every request; the test itself, and the fake
kubelet, talk to the API server directly.
"""

from __future__ import annotations

from tests.support.faults import proxy

__all__ = ["proxy"]
