"""The one-machine cluster: a Kubernetes control plane, a node agent running pods as vllm-sim
processes, a Service proxy, the real Prometheus, and the demo. It imports the operator; the
operator never imports it."""
