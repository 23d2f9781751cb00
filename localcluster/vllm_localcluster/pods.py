"""The pod runner's public name: `from vllm_localcluster.pods import PodRunner`."""

from vllm_localcluster.runner import PORT_ANNOTATION, SIM_COMMAND, PodRunner, RunnerConfig

__all__ = ["PORT_ANNOTATION", "SIM_COMMAND", "PodRunner", "RunnerConfig"]
