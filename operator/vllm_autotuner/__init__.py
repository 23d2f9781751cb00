"""vllm-autotuner: a Kubernetes operator that deploys vLLM and tunes it against SLOs."""

__version__ = "0.1.0"

GROUP = "vllm.autotuner.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
FIELD_MANAGER = "vllm-autotuner"
DEPLOYMENT_LABEL = f"{GROUP}/deployment"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "vllm-autotuner"
