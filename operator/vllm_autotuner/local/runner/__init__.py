"""Deployments become vllm-sim processes: the kubelet and Deployment controller of the local
cluster (see `runner.py` for what it emulates and where it differs on purpose)."""

from vllm_autotuner.local.runner.container import SIM_COMMAND
from vllm_autotuner.local.runner.kubelet import PORT_ANNOTATION
from vllm_autotuner.local.runner.objects import RunnerConfig, TargetGroups
from vllm_autotuner.local.runner.runner import PodRunner

__all__ = ["PORT_ANNOTATION", "SIM_COMMAND", "PodRunner", "RunnerConfig", "TargetGroups"]
