"""A real Kubernetes control plane for the one-machine cluster: built from the Go module in
controlplane/ (binaries.py), started per run with fresh credentials (launcher.py, pki.py)."""

from vllm_localcluster.controlplane.binaries import Binaries, BuildError, MissingBinaries
from vllm_localcluster.controlplane.launcher import ControlPlane, ControlPlaneError

__all__ = ["Binaries", "BuildError", "ControlPlane", "ControlPlaneError", "MissingBinaries"]
