"""Public request traces as simulator arrivals (../shared/traces/README.md), the format read from
the file itself:

* Mooncake JSONL (FAST'25): one object a line, `timestamp` (ms), `input_length`,
  `output_length`, `hash_ids` (one id per 512-token prompt block; equal ids, equal prefixes);
* Azure LLM inference CSV (Splitwise, 2023): `TIMESTAMP` (a date and time), `ContextTokens`,
  `GeneratedTokens`; no prefix information.

Times start at 0 at the first request. Every bad line is an error naming the file, the line and
the field. A prompt longer than the model's context is cut as agents/sim/workload.py cuts it
(room for one output token; the output to what is left), its block ids with it.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from agents.sim.workload import Arrival

MOONCAKE_BLOCK_TOKENS = 512  # traces/README.md: one hash id per 512-token prefix block
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class Trace:
    """A trace's requests in time order."""

    path: str
    format: str  # "mooncake" | "azure"
    arrivals: tuple[Arrival, ...]  # deployment left empty: the caller names it
    block_tokens: int  # what one entry of Arrival.blocks covers (0: the format has no prefix ids)
    clipped: int = 0  # requests cut to the model's context

    @property
    def span_s(self) -> float:
        return self.arrivals[-1].t_s - self.arrivals[0].t_s if self.arrivals else 0.0


def read_trace(path: str | Path, *, deployment: str = "", context_tokens: int | None = None) -> Trace:
    """The trace at `path` (module docstring); `context_tokens` cuts requests to a model's window."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"{p}: cannot read it: {exc.strerror}") from None
    head = text.lstrip()[:1]
    if head == "{":
        trace = _mooncake(p, text, deployment)
    elif text.startswith("TIMESTAMP") or text.lstrip().startswith(AZURE_COLUMNS[0]):
        trace = _azure(p, text, deployment)
    else:
        raise ValueError(f"{p}: neither Mooncake JSONL (a JSON object a line) nor an Azure CSV "
                         f"(header {','.join(AZURE_COLUMNS)})")
    if not trace.arrivals:
        raise ValueError(f"{p}: no requests")
    return _clip(trace, context_tokens) if context_tokens else trace


def _mooncake(p: Path, text: str, deployment: str) -> Trace:
    rows: list[Arrival] = []
    t0: float | None = None
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{p} line {n}: not JSON: {exc}") from None
        if not isinstance(d, dict):
            raise ValueError(f"{p} line {n}: must be a JSON object")
        for key in ("timestamp", "input_length", "output_length"):
            v = d.get(key)
            if isinstance(v, bool) or not isinstance(v, int | float) or v < (0 if key == "timestamp" else 1):
                raise ValueError(f"{p} line {n}.{key}: must be a number >= {0 if key == 'timestamp' else 1}, "
                                 f"got {v!r}")
        ids = d.get("hash_ids", [])
        if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
            raise ValueError(f"{p} line {n}.hash_ids: must be a list of integers")
        t = float(d["timestamp"]) / 1e3
        t0 = t if t0 is None else t0
        if rows and t - t0 < rows[-1].t_s:
            raise ValueError(f"{p} line {n}.timestamp: goes back in time")
        rows.append(Arrival(t - t0, deployment, int(d["input_length"]), int(d["output_length"]), blocks=tuple(ids)))
    return Trace(str(p), "mooncake", tuple(rows), MOONCAKE_BLOCK_TOKENS)


def _azure(p: Path, text: str, deployment: str) -> Trace:
    reader = csv.DictReader(text.splitlines())
    if reader.fieldnames is None or any(c not in reader.fieldnames for c in AZURE_COLUMNS):
        raise ValueError(f"{p}: columns must include {','.join(AZURE_COLUMNS)}; got {reader.fieldnames}")
    rows: list[Arrival] = []
    t0: datetime | None = None
    for n, rec in enumerate(reader, start=2):
        try:
            when = _azure_time(rec["TIMESTAMP"])
        except ValueError:
            raise ValueError(f"{p} line {n}.TIMESTAMP: not a date and time: {rec['TIMESTAMP']!r}") from None
        values = []
        for key in AZURE_COLUMNS[1:]:
            try:
                v = int(rec[key])
            except (TypeError, ValueError):
                raise ValueError(f"{p} line {n}.{key}: must be an integer, got {rec[key]!r}") from None
            if v < 1:
                raise ValueError(f"{p} line {n}.{key}: must be >= 1, got {v}")
            values.append(v)
        t0 = when if t0 is None else t0
        t = (when - t0).total_seconds()
        if rows and t < rows[-1].t_s:
            raise ValueError(f"{p} line {n}.TIMESTAMP: goes back in time")
        rows.append(Arrival(t, deployment, values[0], values[1]))
    return Trace(str(p), "azure", tuple(rows), 0)


def _azure_time(s: str) -> datetime:
    """'2023-11-16 18:17:03.9799600': seven fractional digits, which fromisoformat refuses."""
    date, _, frac = s.strip().partition(".")
    base = datetime.strptime(date, "%Y-%m-%d %H:%M:%S")
    if frac:
        if not frac.isdigit():
            raise ValueError(s)
        return base.replace(microsecond=int((frac + "000000")[:6]))
    return base


def _clip(trace: Trace, context: int) -> Trace:
    out: list[Arrival] = []
    clipped = 0
    for a in trace.arrivals:
        if a.prompt_tokens + a.output_tokens <= context:
            out.append(a)
            continue
        clipped += 1
        prompt = min(a.prompt_tokens, context - 1)
        output = min(a.output_tokens, context - prompt)
        blocks = a.blocks[:-(-prompt // trace.block_tokens)] if trace.block_tokens else a.blocks
        out.append(replace(a, prompt_tokens=prompt, output_tokens=output, blocks=blocks))
    return replace(trace, arrivals=tuple(out), clipped=clipped)
