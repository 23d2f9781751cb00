"""Label and field selectors, as the API server evaluates them on LIST and WATCH.

Operators narrow their watches with selectors (kopf's `labels=` filters become server-side
label selectors; `kubectl get -w NAME` is a `metadata.name` field selector), so an emulator
that ignored them would deliver events a real cluster never sends.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class SelectorError(ValueError):
    """A selector the API server would reject with 400 BadRequest."""


@dataclass(frozen=True)
class LabelRequirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op == "=":
            return present and value in self.values
        if self.op == "in":
            return present and value in self.values
        if self.op == "!=":
            # Kubernetes: `key!=v` also selects objects without the label.
            return not present or value not in self.values
        if self.op == "notin":
            return not present or value not in self.values
        raise SelectorError(f"unknown operator {self.op!r}")  # pragma: no cover


@dataclass(frozen=True)
class FieldRequirement:
    path: str
    op: str  # "=" or "!="
    value: str

    def matches(self, obj: Mapping[str, Any]) -> bool:
        actual = field_value(obj, self.path)
        return (actual == self.value) if self.op == "=" else (actual != self.value)


_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_SET_RE = re.compile(rf"^\s*(?P<key>{_KEY})\s+(?P<op>in|notin)\s*\((?P<values>[^)]*)\)\s*$")
_CMP_RE = re.compile(rf"^\s*(?P<key>{_KEY})\s*(?P<op>==|!=|=)\s*(?P<value>[^=!\s]*)\s*$")
_EXISTS_RE = re.compile(rf"^\s*(?P<neg>!?)\s*(?P<key>{_KEY})\s*$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside `in (a,b)` parentheses."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError(f"unbalanced parentheses in {text!r}")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise SelectorError(f"unbalanced parentheses in {text!r}")
    parts.append("".join(current))
    return [part for part in parts if part.strip()]


def parse_label_selector(text: str | None) -> list[LabelRequirement]:
    if not text:
        return []
    requirements: list[LabelRequirement] = []
    for part in _split_top_level(text):
        if match := _SET_RE.match(part):
            values = frozenset(v.strip() for v in match["values"].split(",") if v.strip())
            requirements.append(LabelRequirement(match["key"], match["op"], values))
        elif match := _CMP_RE.match(part):
            op = "!=" if match["op"] == "!=" else "="
            requirements.append(LabelRequirement(match["key"], op, frozenset({match["value"]})))
        elif match := _EXISTS_RE.match(part):
            op = "!" if match["neg"] else "exists"
            requirements.append(LabelRequirement(match["key"], op))
        else:
            raise SelectorError(f"unable to parse requirement: {part.strip()!r}")
    return requirements


def parse_field_selector(text: str | None) -> list[FieldRequirement]:
    """Parse `path=value` terms; any dotted path is accepted (the real API allows fewer)."""
    if not text:
        return []
    requirements: list[FieldRequirement] = []
    for part in text.split(","):
        if not part.strip():
            continue
        if "!=" in part:
            path, value = part.split("!=", 1)
            op = "!="
        elif "==" in part:
            path, value = part.split("==", 1)
            op = "="
        elif "=" in part:
            path, value = part.split("=", 1)
            op = "="
        else:
            raise SelectorError(f"invalid field selector: {part!r}")
        if not path.strip():
            raise SelectorError(f"invalid field selector: {part!r}")
        requirements.append(FieldRequirement(path.strip(), op, value.strip()))
    return requirements


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The string form of a dotted field; missing fields read as "" as in the real API."""
    current: Any = obj
    for segment in path.split("."):
        if not isinstance(current, Mapping) or segment not in current:
            return ""
        current = current[segment]
    if current is None:
        return ""
    if isinstance(current, bool):
        return "true" if current else "false"
    return str(current)


@dataclass(frozen=True)
class Selector:
    """Both selectors of one request; the empty selector matches everything."""

    labels: tuple[LabelRequirement, ...] = ()
    fields: tuple[FieldRequirement, ...] = ()

    @classmethod
    def parse(cls, label_selector: str | None, field_selector: str | None) -> Selector:
        return cls(
            tuple(parse_label_selector(label_selector)),
            tuple(parse_field_selector(field_selector)),
        )

    def matches(self, obj: Mapping[str, Any] | None) -> bool:
        if obj is None:
            return False
        labels = obj.get("metadata", {}).get("labels") or {}
        return all(r.matches(labels) for r in self.labels) and all(
            r.matches(obj) for r in self.fields
        )
