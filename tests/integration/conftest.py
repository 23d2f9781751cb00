"""Fixtures shared by the integration tests (the API emulator and a client for it)."""

from tests.support.cluster_api import api, emulator

__all__ = ["api", "emulator"]
