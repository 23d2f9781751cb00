"""How far vllm-sim is from real vLLM: replay recorded runs and report the error per metric.

`python -m bench.fidelity [RUNS_FILE ...] [--out DIR] [--seed N] [--quick]`; see docs/fidelity.md.
"""

from bench.fidelity.report import RunReport, compare, markdown, median_errors, to_json

__all__ = ["RunReport", "compare", "markdown", "median_errors", "to_json"]
