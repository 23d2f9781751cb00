"""Validate objects against a CRD the way the API server would, without an API server.

Order as in kube-apiserver: structural defaulting, then OpenAPI schema validation, then the CEL
rules (``x-kubernetes-validations``). The schema is checked with jsonschema after translating the
Kubernetes dialect (boolean exclusiveMinimum, int-or-string, nullable); CEL rules run under celpy
with ``self`` bound to the node, typed by the schema (``number`` fields become doubles even when
YAML wrote ``1``), as in Kubernetes.

Other test suites (Helm chart, fuzzing) reuse this: ``validate(crd, obj)`` returns messages.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import celpy
import jsonschema
from celpy import celtypes
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError

K8S_KEYWORDS = (
    "x-kubernetes-validations",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-int-or-string",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-embedded-resource",
    "x-kubernetes-map-type",
)

# apiextensions-apiserver rejects these in v1 CRD schemas (CRD docs, "Validation").
FORBIDDEN_KEYWORDS = ("$ref", "definitions", "$defs", "patternProperties", "uniqueItems", "const")


@dataclass(frozen=True)
class Violation:
    """One failed check: where, and the message the API server would print."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def crd_schema(crd: dict[str, Any], version: str | None = None) -> dict[str, Any]:
    """The openAPIV3Schema of a CRD version (the storage version by default)."""
    for v in crd["spec"]["versions"]:
        if (version is None and v.get("storage")) or v["name"] == version:
            schema: dict[str, Any] = v["schema"]["openAPIV3Schema"]
            return schema
    raise KeyError(f"no version {version!r} in {crd['metadata']['name']}")


# ---------------------------------------------------------------- structural walking


def iter_nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node with its location (``[]`` marks items, ``{}`` map values)."""
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from iter_nodes(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from iter_nodes(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from iter_nodes(schema["additionalProperties"], f"{path}{{}}")


def structural_problems(schema: dict[str, Any]) -> list[str]:
    """Why a schema is not structural (empty when it is)."""
    problems = []
    for path, node in iter_nodes(schema):
        where = path or "<root>"
        typed = (
            "type" in node
            or node.get("x-kubernetes-int-or-string")
            or node.get("x-kubernetes-preserve-unknown-fields")
        )
        if not typed:
            problems.append(f"{where}: no type")
        for key in FORBIDDEN_KEYWORDS:
            if key in node:
                problems.append(f"{where}: forbidden keyword {key}")
        if node.get("additionalProperties") is False:
            problems.append(f"{where}: additionalProperties: false")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{where}: properties and additionalProperties together")
        for junctor in ("anyOf", "oneOf", "allOf", "not"):
            if junctor in node and not node.get("x-kubernetes-int-or-string"):
                problems.append(f"{where}: {junctor} outside int-or-string")
        if "nullable" in node and not isinstance(node["nullable"], bool):
            problems.append(f"{where}: nullable must be a boolean")
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            if bound in node and not isinstance(node[bound], bool):
                problems.append(f"{where}: {bound} must be a boolean in OpenAPI v3.0")
        if node.get("type") == "array" and "items" not in node:
            problems.append(f"{where}: array without items")
    return problems


# ---------------------------------------------------------------- defaulting


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """A copy of ``value`` with schema defaults filled in, recursively (as the API server does)."""
    value = copy.deepcopy(value)
    _default_in_place(schema, value)
    return value


def _default_in_place(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _default_in_place(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for item in value.values():
                _default_in_place(extra, item)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default_in_place(schema["items"], item)


# ---------------------------------------------------------------- OpenAPI -> JSON Schema


def to_json_schema(node: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    """Translate a Kubernetes OpenAPI v3 schema into JSON Schema 2020-12.

    ``strict`` rejects unknown fields, like kubectl's default ``--validate=strict``; without it
    the API server would silently prune them.
    """
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in K8S_KEYWORDS or key == "nullable":
            continue
        if key == "properties":
            out[key] = {k: to_json_schema(v, strict) for k, v in value.items()}
        elif key == "items" or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = to_json_schema(value, strict)
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and isinstance(value, bool):
            continue
        else:
            out[key] = value
    for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if node.get(key) is True:
            out[key] = out.pop(bound)
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (
        strict
        and node.get("type") == "object"
        and "properties" in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    return out


def schema_violations(schema: dict[str, Any], obj: Any, strict: bool = True) -> list[Violation]:
    """OpenAPI violations of an (already defaulted) object."""
    validator = jsonschema.Draft202012Validator(to_json_schema(schema, strict))
    return [
        Violation("." + ".".join(str(p) for p in error.absolute_path), error.message)
        for error in validator.iter_errors(obj)
    ]


# ---------------------------------------------------------------- CEL


# Created at import: celpy raises the recursion limit when an Environment is built, and
# hypothesis warns when that happens inside a test.
_ENVIRONMENT = celpy.Environment()


@cache
def compile_rule(rule: str) -> Any:
    """A celpy program for one rule; raises celpy.CELParseError when it does not compile."""
    return _ENVIRONMENT.program(_ENVIRONMENT.compile(rule))


def to_cel(schema: dict[str, Any], value: Any) -> Any:
    """A JSON value as the CEL type its schema declares (Kubernetes types CEL by the schema)."""
    kind = schema.get("type")
    if value is None:
        return None
    if kind == "number":
        return celtypes.DoubleType(float(value))
    if kind == "integer":
        return celtypes.IntType(value)
    if kind == "string":
        return celtypes.StringType(value)
    if kind == "boolean":
        return celtypes.BoolType(value)
    if kind == "array":
        items = schema.get("items", {})
        return celtypes.ListType([to_cel(items, v) for v in value])
    if kind == "object" and "properties" in schema:
        props = schema["properties"]
        return celtypes.MapType(
            {
                celtypes.StringType(k): to_cel(props.get(k, {}), v)
                for k, v in value.items()
                if k in props
            }
        )
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        extra = schema["additionalProperties"]
        return celtypes.MapType(
            {celtypes.StringType(k): to_cel(extra, v) for k, v in value.items()}
        )
    return json_to_cel(value)


def evaluate_rule(rule: str, schema: dict[str, Any], value: Any) -> bool | str:
    """True/False, or the evaluation error text (an unguarded optional field, a type mismatch)."""
    program = compile_rule(rule)
    try:
        result = program.evaluate({"self": to_cel(schema, value)})
    except CELEvalError as error:
        return f"CEL evaluation error: {error.args[0] if error.args else error}"
    if isinstance(result, CELEvalError):
        return f"CEL evaluation error: {result.args[0] if result.args else result}"
    return bool(result)


def cel_violations(schema: dict[str, Any], obj: Any, path: str = "") -> list[Violation]:
    """Failed CEL rules, evaluated on every node present in ``obj`` (defaults already applied)."""
    out = []
    for rule in schema.get("x-kubernetes-validations", []):
        verdict = evaluate_rule(rule["rule"], schema, obj)
        if verdict is not True:
            message = verdict if isinstance(verdict, str) else rule.get("message", rule["rule"])
            out.append(Violation(path + rule.get("fieldPath", ""), message))
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in obj and obj[name] is not None:
                out.extend(cel_violations(sub, obj[name], f"{path}.{name}"))
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in obj.items():
                out.extend(cel_violations(extra, item, f"{path}.{key}"))
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            out.extend(cel_violations(schema["items"], item, f"{path}[{i}]"))
    return out


def all_rules(schema: dict[str, Any]) -> list[tuple[str, dict[str, str]]]:
    """Every CEL rule with the path of the node that carries it."""
    return [
        (path, rule)
        for path, node in iter_nodes(schema)
        for rule in node.get("x-kubernetes-validations", [])
    ]


# ---------------------------------------------------------------- all together


def validate(crd: dict[str, Any], obj: dict[str, Any], strict: bool = True) -> list[Violation]:
    """Everything the API server would reject in ``obj`` on create (empty list: accepted)."""
    schema = crd_schema(crd)
    defaulted = apply_defaults(schema, obj)
    problems = schema_violations(schema, defaulted, strict)
    if problems:
        # The API server reports schema errors and CEL errors together, but CEL on a node that
        # failed its schema is meaningless here (types may be wrong), so stop at the schema.
        return problems
    return cel_violations(schema, defaulted)
