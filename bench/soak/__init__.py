"""Soak benchmark: the one-machine cluster with traffic and faults over hours of simulated
time (`python -m bench.soak`, results in docs/scale.md)."""
