"""An in-memory Prometheus for the virtual-time loop: a time-series store and the PromQL the
operator's adapter sends, evaluated with Prometheus' own semantics.

Why not shortcut into the simulator: the tuner must see what Prometheus would show — counters
sampled at the scrape interval, counter resets when a pod restarts, `increase()` with its
extrapolation to the window's edges, histogram buckets summed over pods — through the same
`PrometheusSource` assembly code as in production. `SimTransport` answers the adapter's
`_Transport` protocol (`query`, `label_values`) from `TSDB`; the evaluator covers exactly the
shapes `adapters.promql.build_query` emits (selectors with `=`, `!=`, `=~`, `!~`; `increase`,
`rate`, `idelta`, `avg_over_time`, `max_over_time`, `last_over_time`, `stdvar_over_time`,
`count_over_time`, over a range or over a subquery `(...)[range:step]`, with an `offset`;
`clamp_min`, `label_replace`; `sum`, `avg`, `max`, `min`, `count` with `by`; `or`) and raises
on anything else, so a new query shape in the adapter fails loudly here instead of being
answered wrongly.

Semantics follow Prometheus 2.x: a range `[W]` selects samples in [t-W, t]; `increase` is
`extrapolatedRate` (counter-reset correction, extrapolation to the window edges when the gap is
under 1.1 average intervals, else by half an interval, never below zero for counters).
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Labels = tuple[tuple[str, str], ...]
Instant = list[tuple[dict[str, str], float]]
_Windowed = tuple[dict[str, str], list[float], list[float]]  # labels, times, values


@dataclass
class _Series:
    labels: dict[str, str]
    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


class TSDB:
    """Samples appended in time order per series (one scrape appends one sample per series)."""

    def __init__(self) -> None:
        self._series: dict[Labels, _Series] = {}
        self._by_name: dict[str, list[_Series]] = {}

    def append(self, labels: Mapping[str, str], t: float, value: float) -> None:
        key = tuple(sorted(labels.items()))
        s = self._series.get(key)
        if s is None:
            s = _Series(dict(labels))
            self._series[key] = s
            self._by_name.setdefault(labels["__name__"], []).append(s)
        s.times.append(t)
        s.values.append(value)

    def names(self) -> list[str]:
        return list(self._by_name)

    def select(self, matchers: list[tuple[str, str, str]]) -> list[_Series]:
        preds = [_matcher(n, op, v) for n, op, v in matchers]
        name_eq = next((v for n, op, v in matchers if n == "__name__" and op == "="), None)
        pool: Iterable[_Series] = (
            self._by_name.get(name_eq, []) if name_eq is not None else self._series.values()
        )
        return [s for s in pool if all(p(s.labels) for p in preds)]

    def __len__(self) -> int:
        return sum(len(s.times) for s in self._series.values())


def _matcher(name: str, op: str, value: str) -> Any:
    if op in ("=~", "!~"):
        rx = re.compile(value)
        if op == "=~":
            return lambda labels: rx.fullmatch(labels.get(name, "")) is not None
        return lambda labels: rx.fullmatch(labels.get(name, "")) is None
    if op == "=":
        return lambda labels: labels.get(name, "") == value
    return lambda labels: labels.get(name, "") != value


# ------------------------------------------------------------------------------- tokenizer

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<str>"(?:[^"\\]|\\.)*")
    | (?P<dur>\[\s*\d+(?:\.\d+)?[smhd]\s*(?::\s*\d+(?:\.\d+)?[smhd]\s*)?\])
    | (?P<op>=~|!~|!=|=|\(|\)|\{|\}|,)
    | (?P<num>\d+(?:\.\d+)?)
    | (?P<id>[a-zA-Z_:][a-zA-Z0-9_:]*)
    )""",
    re.VERBOSE,
)
_UNIT = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_ESC = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"'}


def _unquote(lit: str) -> str:
    body = lit[1:-1]
    out: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        nxt = body[i + 1]
        if nxt in _ESC:
            out.append(_ESC[nxt])
            i += 2
        elif nxt == "x":
            out.append(chr(int(body[i + 2 : i + 4], 16)))
            i += 4
        elif nxt == "u":
            out.append(chr(int(body[i + 2 : i + 6], 16)))
            i += 6
        elif nxt == "U":
            out.append(chr(int(body[i + 2 : i + 10], 16)))
            i += 10
        else:  # a regex escape such as \. stays for the regex engine
            out.append("\\" + nxt)
            i += 2
    return "".join(out)


def _tokens(expr: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    expr = expr.rstrip()
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"PromQL the simulator does not speak at {expr[pos : pos + 30]!r}")
        kind = m.lastgroup
        assert kind is not None
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


# ---------------------------------------------------------------------------------- parser

_AGGS = {"sum", "avg", "max", "min", "count"}
_RANGE_FUNCS = {
    "increase", "rate", "idelta", "avg_over_time", "max_over_time", "last_over_time",
    "stdvar_over_time", "count_over_time",
}  # fmt: skip


@dataclass(frozen=True)
class _Sel:
    matchers: list[tuple[str, str, str]]
    range_s: float | None


@dataclass(frozen=True)
class _Call:
    fn: str
    args: list[Any]


@dataclass(frozen=True)
class _Agg:
    op: str
    by: list[str]
    arg: Any


@dataclass(frozen=True)
class _Sub:
    """A subquery `(inner)[range:step] offset o`: `inner` evaluated every `step` seconds (at
    multiples of it, as Prometheus aligns them) over (t - o - range, t - o]."""

    inner: Any
    range_s: float
    step_s: float
    offset_s: float = 0.0


@dataclass(frozen=True)
class _Num:
    value: float


@dataclass(frozen=True)
class _Or:
    left: Any
    right: Any


class _Parser:
    def __init__(self, expr: str) -> None:
        self.toks = _tokens(expr)
        self.i = 0

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, value: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok is None or (value is not None and tok[1] != value):
            raise ValueError(f"expected {value!r}, got {tok!r}")
        self.i += 1
        return tok

    def parse(self) -> Any:
        node = self.expr()
        if self.peek() is not None:
            raise ValueError(f"trailing PromQL: {self.peek()!r}")
        return node

    def expr(self) -> Any:
        node = self.unary()
        while self.peek() == ("id", "or"):
            self.take()
            node = _Or(node, self.unary())
        return node

    def unary(self) -> Any:
        tok = self.peek()
        if tok is None:
            raise ValueError("unexpected end of PromQL")
        kind, text = tok
        if text == "(":
            self.take("(")
            node = self.expr()
            self.take(")")
            tok = self.peek()
            if tok is not None and tok[0] == "dur" and ":" in tok[1]:
                self.take()
                span, step = tok[1].strip("[] \t").split(":")
                offset = 0.0
                if self.peek() == ("id", "offset"):
                    self.take()
                    number = self.take()[1]
                    offset = _seconds(number + self.take()[1])
                return _Sub(node, _seconds(span), _seconds(step), offset)
            return node
        if kind == "num":
            self.take()
            return _Num(float(text))
        if text == "{":
            return self.selector(None)
        if kind != "id":
            raise ValueError(f"unexpected {text!r}")
        self.take()
        if text in _AGGS:
            by: list[str] = []
            if self.peek() == ("id", "by"):
                self.take()
                by = self.label_list()
            self.take("(")
            arg = self.expr()
            self.take(")")
            return _Agg(text, by, arg)
        if text in _RANGE_FUNCS or text in ("label_replace", "clamp_min"):
            self.take("(")
            args: list[Any] = []
            while True:
                nxt = self.peek()
                if nxt is not None and nxt[0] == "str":
                    args.append(_unquote(self.take()[1]))
                else:
                    args.append(self.expr())
                if self.peek() == ("op", ","):
                    self.take()
                    continue
                break
            self.take(")")
            return _Call(text, args)
        return self.selector(text)

    def label_list(self) -> list[str]:
        self.take("(")
        out: list[str] = []
        while self.peek() != ("op", ")"):
            out.append(self.take()[1])
            if self.peek() == ("op", ","):
                self.take()
        self.take(")")
        return out

    def selector(self, name: str | None) -> _Sel:
        matchers: list[tuple[str, str, str]] = []
        if name is not None:
            matchers.append(("__name__", "=", name))
        if self.peek() == ("op", "{"):
            self.take()
            while self.peek() != ("op", "}"):
                label = self.take()[1]
                op = self.take()[1]
                kind, lit = self.take()
                if kind != "str" or op not in ("=", "!=", "=~", "!~"):
                    raise ValueError(f"bad matcher {label}{op}{lit}")
                matchers.append((label, op, _unquote(lit)))
                if self.peek() == ("op", ","):
                    self.take()
            self.take("}")
        range_s: float | None = None
        tok = self.peek()
        if tok is not None and tok[0] == "dur":
            self.take()
            range_s = _seconds(tok[1].strip("[] \t"))
        return _Sel(matchers, range_s)


def _seconds(text: str) -> float:
    text = text.strip()
    return float(text[:-1]) * _UNIT[text[-1]]


# ------------------------------------------------------------------------------- evaluation


def _window(s: _Series, t: float, w: float) -> tuple[list[float], list[float]]:
    lo = bisect.bisect_left(s.times, t - w)
    hi = bisect.bisect_right(s.times, t)
    return s.times[lo:hi], s.values[lo:hi]


def extrapolated_increase(times: list[float], values: list[float], t: float, w: float) -> float:
    """Prometheus 2.x `increase()` of one counter series over [t-w, t] (needs 2 samples)."""
    n = len(times)
    result = values[-1] - values[0]
    for a, b in itertools.pairwise(values):
        if b < a:
            result += a
    sampled = times[-1] - times[0]
    to_start = times[0] - (t - w)
    to_end = t - times[-1]
    avg = sampled / (n - 1)
    if result > 0 and values[0] >= 0:
        to_zero = sampled * (values[0] / result)
        to_start = min(to_start, to_zero)
    threshold = avg * 1.1
    interval = sampled
    interval += to_start if to_start < threshold else avg / 2
    interval += to_end if to_end < threshold else avg / 2
    return result * (interval / sampled)


def _no_name(labels: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if k != "__name__"}


class Evaluator:
    def __init__(self, db: TSDB) -> None:
        self.db = db

    def query(self, expr: str, t: float) -> Instant:
        return self._eval(_Parser(expr).parse(), t)

    def _eval(self, node: Any, t: float) -> Instant:
        if isinstance(node, _Or):
            left = self._eval(node.left, t)
            seen = {tuple(sorted(_no_name(lab).items())) for lab, _ in left}
            right = [
                (lab, v)
                for lab, v in self._eval(node.right, t)
                if tuple(sorted(_no_name(lab).items())) not in seen
            ]
            return left + right
        if isinstance(node, _Agg):
            return self._agg(node, self._eval(node.arg, t))
        if isinstance(node, _Call):
            return self._call(node, t)
        if isinstance(node, _Sel):
            if node.range_s is not None:
                raise ValueError("a range vector is not an instant query result")
            out: Instant = []
            for s in self.db.select(node.matchers):
                times, values = _window(s, t, 300.0)  # lookback delta 5 min
                if times:
                    out.append((dict(s.labels), values[-1]))
            return out
        raise ValueError(f"cannot evaluate {node!r}")

    def _call(self, node: _Call, t: float) -> Instant:
        if node.fn == "label_replace":
            inner, dst, repl, src, regex = node.args
            rx = re.compile(regex)
            out: Instant = []
            for labels, v in self._eval(inner, t):
                m = rx.fullmatch(labels.get(src, ""))
                if m is not None:
                    labels = dict(labels)
                    template = re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", repl.replace("\\", "\\\\"))
                    value = m.expand(template)
                    if value:
                        labels[dst] = value
                    else:
                        labels.pop(dst, None)
                out.append((labels, v))
            return out
        if node.fn == "clamp_min":
            inner, low = node.args
            if not isinstance(low, _Num):
                raise ValueError("clamp_min takes a number")
            return [(_no_name(lab), max(v, low.value)) for lab, v in self._eval(inner, t)]
        (arg,) = node.args
        if isinstance(arg, _Sub):
            return self._over_time(node.fn, self._subquery(arg, t), t, arg.range_s)
        if not isinstance(arg, _Sel) or arg.range_s is None:
            raise ValueError(f"{node.fn} needs a range selector")
        w = arg.range_s
        windows = []
        for s in self.db.select(arg.matchers):
            times, values = _window(s, t, w)
            if times:
                windows.append((s.labels, times, values))
        return self._over_time(node.fn, windows, t, w)

    def _subquery(self, sub: _Sub, t: float) -> list[_Windowed]:
        """`sub.inner` at every multiple of the step in (t - range, t], as series."""
        t -= sub.offset_s
        first = math.floor((t - sub.range_s) / sub.step_s) * sub.step_s + sub.step_s
        series: dict[Labels, _Windowed] = {}
        k = 0
        while (at := first + k * sub.step_s) <= t + 1e-9:
            for labels, v in self._eval(sub.inner, at):
                key = tuple(sorted(labels.items()))
                found = series.setdefault(key, (labels, [], []))
                found[1].append(at)
                found[2].append(v)
            k += 1
        return list(series.values())

    @staticmethod
    def _over_time(
        fn: str,
        windows: Iterable[_Windowed],
        t: float,
        w: float,
    ) -> Instant:
        result: Instant = []
        for raw_labels, times, values in windows:
            labels = dict(raw_labels) if fn == "last_over_time" else _no_name(raw_labels)
            if fn in ("increase", "rate", "idelta"):
                if len(times) < 2:
                    continue
                if fn == "idelta":
                    result.append((labels, values[-1] - values[-2]))
                    continue
                inc = extrapolated_increase(times, values, t, w)
                result.append((labels, inc / w if fn == "rate" else inc))
            elif fn == "avg_over_time":
                result.append((labels, sum(values) / len(values)))
            elif fn == "stdvar_over_time":
                mean = sum(values) / len(values)
                result.append((labels, sum((v - mean) ** 2 for v in values) / len(values)))
            elif fn == "count_over_time":
                result.append((labels, float(len(values))))
            elif fn == "max_over_time":
                result.append((labels, max(values)))
            else:
                result.append((labels, values[-1]))
        return result

    @staticmethod
    def _agg(node: _Agg, vec: Instant) -> Instant:
        groups: dict[tuple[str, ...], list[float]] = {}
        for labels, v in vec:
            key = tuple(labels.get(name, "") for name in node.by)
            groups.setdefault(key, []).append(v)
        out: Instant = []
        for key, vs in groups.items():
            labels = {n: x for n, x in zip(node.by, key, strict=True) if x}
            if node.op == "sum":
                value = math.fsum(vs)
            elif node.op == "avg":
                value = math.fsum(vs) / len(vs)
            elif node.op == "max":
                value = max(vs)
            elif node.op == "min":
                value = min(vs)
            else:
                value = float(len(vs))
            out.append((labels, value))
        return out


class SimTransport:
    """The adapter's `_Transport` over a TSDB: answers like Prometheus' HTTP API `data`."""

    def __init__(self, db: TSDB, offset: float = 0.0) -> None:
        self.db = db
        self.evaluator = Evaluator(db)
        self.queries = 0
        self.offset = offset  # wall-clock epoch of the TSDB's t = 0

    async def query(self, expr: str, at: float) -> Any:
        self.queries += 1
        return [
            {"metric": labels, "value": [at, repr(float(v))]}
            for labels, v in self.evaluator.query(expr, at - self.offset)
        ]

    async def label_values(self, label: str, match: str, start: float, end: float) -> Any:
        sel = _Parser(match).parse()
        if not isinstance(sel, _Sel):
            raise ValueError("label_values takes a selector")
        found: set[str] = set()
        start, end = start - self.offset, end - self.offset
        for s in self.db.select(sel.matchers):
            lo = bisect.bisect_left(s.times, start)
            if lo < len(s.times) and s.times[lo] <= end and label in s.labels:
                found.add(s.labels[label])
        return sorted(found)
