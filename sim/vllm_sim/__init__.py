"""vllm-sim: a step-level simulator of a vLLM V1 server (engine, OpenAI API, metrics, load)."""

__version__ = "0.1.0"
VLLM_VERSION = "0.33.0"
