"""Tuning-quality benchmark: the tuner against the oracle and its peers (issue 5)."""
