"""The pod runner's public name: `from vllm_autotuner.local.pods import PodRunner`."""

from vllm_autotuner.local.runner import PORT_ANNOTATION, SIM_COMMAND, PodRunner, RunnerConfig

__all__ = ["PORT_ANNOTATION", "SIM_COMMAND", "PodRunner", "RunnerConfig"]
