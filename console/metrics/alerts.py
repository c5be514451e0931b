"""The alert rules of deploy/prometheus/alerts.yml, evaluated in-process over the console's own metrics.

Prometheus evaluates the file over what it scrapes; the console's Alerts page and /api/v1/alerts
evaluate the very same rules over `console.metrics.REGISTRY` as it stands now, so the two cannot
drift. That is honest only for expressions whose meaning needs no history, so the parser takes a
small subset of PromQL and refuses everything else with `Unsupported` (a test walks every rule):

    expr   := [AGG "by" "(" labels ")"] "(" selector ")" CMP number  |  selector CMP number
    AGG    := sum | max | min | count          CMP := > | >= | < | <= | == | !=
    selector := metric_name ["{" label ("=" | "!=") "string" {"," ...} "}"]

Templates in annotations: `{{ $labels.NAME }}` and `{{ printf "%.Nf" $value }}` only.

`for:` needs to know since when an alert holds. The console keeps that in Redis (one hash shared by
every web process): the first evaluation that sees an alert active stamps it, one that sees it gone
clears it. So "since" is since the console first saw it (Celery beat evaluates every
FLEXPIPE_ALERTS_EVAL_S, 15 s - console/metrics/tasks.py - and so does each page view and API call);
until `for` has passed the alert is `pending`, then `firing`. Without Redis an alert with a `for`
stays pending and shows no "since" - never a made-up time.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

RULES_PATH = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"
REDIS_KEY = "flexpipe:alerts:active-since"

# Metrics the rules read that nothing exports yet: the parts of issue 16 that will. A test fails once
# one of them is exported (drop it from here then) and for any other name no collector yields.
PLANNED_METRICS: Mapping[str, str] = {}

AGGREGATIONS = ("sum", "max", "min", "count")
COMPARISONS = {">": lambda a, b: a > b, ">=": lambda a, b: a >= b, "<": lambda a, b: a < b,
               "<=": lambda a, b: a <= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r"[a-zA-Z_][a-zA-Z0-9_]*"
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_MATCHER = re.compile(rf'\s*({_LABEL})\s*(!=|=)\s*"((?:[^"\\]|\\.)*)"\s*')
_SELECTOR = rf"({_NAME})\s*(?:\{{([^{{}}]*)\}})?"
_PLAIN = re.compile(rf"^\s*{_SELECTOR}\s*(>=|<=|==|!=|>|<)\s*({_NUMBER})\s*$")
_AGGREGATED = re.compile(rf"^\s*({'|'.join(AGGREGATIONS)})\s+by\s*\(([^()]*)\)\s*\(\s*{_SELECTOR}\s*\)"
                         rf"\s*(>=|<=|==|!=|>|<)\s*({_NUMBER})\s*$")
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w)")
_DURATION_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_TEMPLATE = re.compile(r"\{\{(.*?)\}\}")
_LABEL_REF = re.compile(rf"^\s*\$labels\.({_LABEL})\s*$")
_PRINTF = re.compile(r'^\s*printf\s+"%\.(\d)f"\s+\$value\s*$')


class Unsupported(ValueError):
    """A rule outside the subset this evaluator can evaluate honestly (module docstring)."""


@dataclass(frozen=True)
class Expr:
    metric: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, "=" | "!=", value)
    op: str  # one of COMPARISONS
    threshold: float
    aggregation: str | None = None  # one of AGGREGATIONS, or None: each series on its own
    by: tuple[str, ...] = ()  # the labels an aggregation keeps

    def selects(self, labels: Mapping[str, str]) -> bool:
        return all((labels.get(k, "") == v) == (op == "=") for k, op, v in self.matchers)


@dataclass(frozen=True)
class Rule:
    name: str
    expr_text: str
    expr: Expr
    for_s: float
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True)
class Active:
    """One alert that holds now: a rule and one output series of its expression."""

    rule: Rule
    labels: Mapping[str, str]  # the series' labels, the rule's labels, alertname
    value: float
    annotations: Mapping[str, str]

    @property
    def key(self) -> str:
        return json.dumps(sorted(self.labels.items()))


def parse_expr(text: str) -> Expr:
    m = _AGGREGATED.match(text)
    if m is not None:
        agg, by_text, metric, matchers, op, number = m.groups()
        by = tuple(b.strip() for b in by_text.split(",") if b.strip())
        if not by or any(not re.fullmatch(_LABEL, b) for b in by):
            raise Unsupported(f"{text!r}: `by (...)` must name one or more labels")
        return Expr(metric, _matchers(matchers, text), op, float(number), agg, by)
    m = _PLAIN.match(text)
    if m is not None:
        metric, matchers, op, number = m.groups()
        if metric in AGGREGATIONS or metric in ("by", "without", "bool"):
            raise Unsupported(f"{text!r}: {metric} is not a metric")
        return Expr(metric, _matchers(matchers, text), op, float(number))
    raise Unsupported(f"{text!r}: outside the subset the console evaluates: `METRIC{{...}} OP NUMBER` or "
                      f"`{'|'.join(AGGREGATIONS)} by (labels) (METRIC{{...}}) OP NUMBER`; no functions, ranges, "
                      "offsets, `bool`, `without`, regex matchers or vector-to-vector operations")


def _matchers(text: str | None, expr: str) -> tuple[tuple[str, str, str], ...]:
    if not text or not text.strip():
        return ()
    out = []
    for part in text.split(","):
        m = _MATCHER.fullmatch(part)
        if m is None:
            raise Unsupported(f"{expr!r}: label matcher {part.strip()!r} must be label=\"value\" or label!=\"value\"")
        out.append((m.group(1), m.group(2), m.group(3).replace('\\"', '"').replace("\\\\", "\\")))
    return tuple(out)


def parse_duration(text: str) -> float:
    """Prometheus durations: 90s, 5m, 1h30m (units ms, s, m, h, d, w, largest first)."""
    if not text:
        return 0.0
    parts = _DURATION.findall(text)
    if "".join(n + u for n, u in parts) != text:
        raise Unsupported(f"for: {text!r} is not a duration like 30s, 5m or 1h30m")
    return float(sum(int(n) * _DURATION_S[u] for n, u in parts))


def check_template(text: str, where: str) -> None:
    for inner in _TEMPLATE.findall(text):
        if not (_LABEL_REF.match(inner) or _PRINTF.match(inner)):
            raise Unsupported(f"{where}: template {{{{{inner}}}}} - only {{{{ $labels.NAME }}}} and "
                              '{{ printf "%.Nf" $value }} are rendered by the console')


def render(text: str, labels: Mapping[str, str], value: float) -> str:
    def one(m: re.Match[str]) -> str:
        ref = _LABEL_REF.match(m.group(1))
        if ref is not None:
            return labels.get(ref.group(1), "")  # Go templates print a missing label as nothing too
        fmt = _PRINTF.match(m.group(1))
        assert fmt is not None  # noqa: S101 - check_template refused anything else at load
        return f"{value:.{int(fmt.group(1))}f}"

    return _TEMPLATE.sub(one, text)


def parse_rules(doc: Any, source: str = "alerts.yml") -> tuple[Rule, ...]:
    """Every alerting rule of a Prometheus rule file; Unsupported names the first rule it cannot take."""
    if not isinstance(doc, dict) or not isinstance(doc.get("groups"), list):
        raise Unsupported(f"{source}: must be a mapping with a `groups` list")
    rules = []
    for group in doc["groups"]:
        for raw in group.get("rules", []) if isinstance(group, dict) else []:
            if "alert" not in raw:
                raise Unsupported(f"{source}: recording rule {raw.get('record')!r}: the console evaluates alerts only")
            name = str(raw["alert"])
            try:
                expr = parse_expr(str(raw["expr"]))
                for_s = parse_duration(str(raw.get("for", "")))
                annotations = {str(k): str(v) for k, v in (raw.get("annotations") or {}).items()}
                for k, v in annotations.items():
                    check_template(v, f"annotation {k}")
                labels = {str(k): str(v) for k, v in (raw.get("labels") or {}).items()}
                for k, v in labels.items():
                    check_template(v, f"label {k}")
                    if _TEMPLATE.search(v):
                        raise Unsupported(f"label {k}: templated labels are not evaluated by the console")
            except Unsupported as exc:
                raise Unsupported(f"{source}: alert {name}: {exc}") from None
            rules.append(Rule(name, str(raw["expr"]), expr, for_s, labels, annotations))
    return tuple(rules)


def load_rules(path: Path = RULES_PATH) -> tuple[Rule, ...]:
    return parse_rules(yaml.safe_load(path.read_text()), path.name)


def registry_samples(registry: Any = None, names: Iterable[str] | None = None) -> list[Sample]:
    """The registry's samples now (the state collectors read the database: call from sync code).
    `names`: only these families, collected from only the collectors that yield them
    (collectors.Described) - the rules' metrics, not the whole fleet's (issue 19)."""
    if registry is None:
        from console.metrics import REGISTRY
        from console.metrics.views import register_collectors

        register_collectors()
        registry = REGISTRY
    if names is not None:
        registry = registry.restricted_registry(list(names))
    return [Sample(s.name, dict(s.labels), float(s.value)) for fam in registry.collect() for s in fam.samples]


def evaluate(rules: Iterable[Rule], samples: Iterable[Sample]) -> list[Active]:
    """The alerts that hold over these samples, as Prometheus would find them at one instant."""
    by_name: dict[str, list[Sample]] = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)
    out = []
    for rule in rules:
        e = rule.expr
        series = [s for s in by_name.get(e.metric, []) if e.selects(s.labels) and not math.isnan(s.value)]
        if e.aggregation is not None:
            series = _aggregate(e.aggregation, e.by, series)
        for s in series:
            if COMPARISONS[e.op](s.value, e.threshold):
                labels = {**s.labels, **rule.labels, "alertname": rule.name}
                notes = {k: render(v, labels, s.value) for k, v in rule.annotations.items()}
                out.append(Active(rule, labels, s.value, notes))
    return out


def _aggregate(how: str, by: tuple[str, ...], series: list[Sample]) -> list[Sample]:
    groups: dict[tuple[str, ...], list[float]] = {}
    for s in series:
        groups.setdefault(tuple(s.labels.get(b, "") for b in by), []).append(s.value)
    pick = {"sum": sum, "max": max, "min": min, "count": len}[how]
    # Prometheus drops a grouping label whose value is empty (a series without it)
    return [Sample("", {b: v for b, v in zip(by, key, strict=True) if v}, float(pick(values)))  # type: ignore[operator]
            for key, values in groups.items()]


@dataclass(frozen=True)
class AlertState:
    active: Active
    state: str  # pending | firing
    since_s: float | None  # when the console first saw it hold (None: unknown, Redis unreachable)


def with_since(actives: list[Active], now_s: float) -> list[AlertState]:
    """Pending or firing for each active alert, by when the console first saw it (module docstring)."""
    import redis
    from django.conf import settings

    try:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1.0, socket_connect_timeout=1.0)
        keys = {a.key for a in actives}
        for a in actives:
            client.hsetnx(REDIS_KEY, a.key, repr(now_s))
        known = {k.decode(): float(v) for k, v in client.hgetall(REDIS_KEY).items()}
        gone = [k for k in known if k not in keys]
        if gone:
            client.hdel(REDIS_KEY, *gone)
    except (OSError, ValueError, redis.RedisError):
        known = {}
    out = []
    for a in actives:
        since = known.get(a.key)
        held = since is not None and now_s - since >= a.rule.for_s
        out.append(AlertState(a, "firing" if a.rule.for_s == 0 or held else "pending", since))
    return out


def current(now_s: float) -> tuple[tuple[Rule, ...], list[AlertState]]:
    """The rules and what holds now over the console's metrics, firing first, then by name and labels."""
    rules = load_rules()
    states = with_since(evaluate(rules, registry_samples(names={r.expr.metric for r in rules})), now_s)
    states.sort(key=lambda s: (s.state != "firing", s.active.rule.name, s.active.key))
    return rules, states
