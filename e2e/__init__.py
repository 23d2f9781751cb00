"""Closed-loop end-to-end scenarios (local cluster) and the kind scripts' checks."""
