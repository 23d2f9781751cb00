"""Fixtures shared by the integration tests (the API emulator and a client for it)."""

from tests.support.cluster_api import api, apiserver

__all__ = ["api", "apiserver"]
