"""The node agent: pods bound to the cluster's nodes run as local processes (KWOK-like)."""

from vllm_localcluster.node.agent import NodeAgent, NodeSpec, default_nodes
from vllm_localcluster.node.container import SIM_COMMAND
from vllm_localcluster.node.kubelet import KubeletConfig, TargetGroups

__all__ = ["SIM_COMMAND", "KubeletConfig", "NodeAgent", "NodeSpec", "TargetGroups", "default_nodes"]
