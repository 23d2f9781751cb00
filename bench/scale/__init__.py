"""Scale benchmark: many VLLMDeployments against the API emulator and a Prometheus stub
(`python -m bench.scale`, results in docs/scale.md)."""
