"""Whole objects as the API returns them: metadata stays a plain dict (the API server owns it)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vllm_autotuner import API_VERSION
from vllm_autotuner.api.deployment import VLLMDeploymentSpec
from vllm_autotuner.api.policy import VLLMTuningPolicySpec
from vllm_autotuner.api.status import VLLMDeploymentStatus, VLLMTuningPolicyStatus


class _Resource(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    api_version: str = Field(
        default=API_VERSION, alias="apiVersion", pattern=f"^{re.escape(API_VERSION)}$"
    )
    metadata: dict[str, Any] = Field(default_factory=dict)


class VLLMDeployment(_Resource):
    """A VLLMDeployment object; ``status`` may be absent on a fresh object."""

    kind: Literal["VLLMDeployment"] = "VLLMDeployment"
    spec: VLLMDeploymentSpec
    status: VLLMDeploymentStatus = Field(default_factory=VLLMDeploymentStatus)


class VLLMTuningPolicy(_Resource):
    """A VLLMTuningPolicy object (cluster-scoped: metadata has no namespace)."""

    kind: Literal["VLLMTuningPolicy"] = "VLLMTuningPolicy"
    spec: VLLMTuningPolicySpec
    status: VLLMTuningPolicyStatus = Field(default_factory=VLLMTuningPolicyStatus)
