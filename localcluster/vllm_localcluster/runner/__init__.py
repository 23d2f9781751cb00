"""Deployments become vllm-sim processes: the kubelet and Deployment controller of the local
cluster (see `runner.py` for what it emulates and where it differs on purpose)."""

from vllm_localcluster.runner.container import SIM_COMMAND
from vllm_localcluster.runner.kubelet import PORT_ANNOTATION
from vllm_localcluster.runner.objects import RunnerConfig, TargetGroups
from vllm_localcluster.runner.runner import PodRunner

__all__ = ["PORT_ANNOTATION", "SIM_COMMAND", "PodRunner", "RunnerConfig", "TargetGroups"]
