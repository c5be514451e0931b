"""Replay one scenario under several scheduling policies, in one process, and compare them.

    python -m bench.replay SCENARIO [--policies a,b] [--json PATH] [--html PATH] [--no-timing] [--pin-cpu]
                                    [--no-trend]

Policies (agents.sim.policies): static, static-replicas, restart, flexpipe, oracle (default: all).
Prints, per policy: tokens served, requests finished and lost, goodput (requests meeting both
SLOs per second), TTFT and end-to-end P50/P95/P99, the worst 5-minute P95 after any cluster
change and the steady P95, switches and their durations, the time from each change to the new
gear serving, GPU memory and compute utilisation; then every policy's ratios against flexpipe
and against the oracle, and the issue's targets as measured (definitions: agents/sim/metrics.py).

--json writes the whole result (per policy: the figures above under the keys tokens, finished,
lost, goodput_rps, ttft_p95_s, e2e_p95_s, worst_p95_after_event_s, steady_p95_s, switches,
event_to_serving_s, mem_util, compute_util, peak_gpu_mem_fraction (the largest share of any GPU's
memory booked after any booking: every plan holding it counted, invariant 4), refused_prepares
(PREPAREs the simulated agents refused for memory), memory_violations (what the invariant checker
finds above 0.92), and more; plus wall_s and cpu_s of the whole run).
The result is byte-identical for the same scenario and seed except those two timings;
--no-timing leaves them out. --html writes a self-contained plotly report (plotly.js inlined):
throughput and P95 over time per policy with the changes marked, and FlexPipe's gear timeline.

--no-trend runs flexpipe on the load's level alone (scheduler.gearbox.planned_load: no forecast
from the load window's trend), the way it ran before the trend: an A/B in two runs.

Timing: wall-clock and CPU seconds of the whole run (workload, every policy, summaries), and
per policy. --pin-cpu runs the process on one core (the first it may use), so "wall on one
core" means what it says on a shared machine; compare CPU with wall to see contention.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from agents.schema import SchemaError
from agents.sim.policies import ALL_POLICIES, PolicyOptions, make_policy
from agents.sim.run import replay, to_json
from agents.sim.scenario import load_scenario
from scheduler.gearbox import DEFAULT_CONFIG


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 1e5:
            return f"{v:.3g}"
        return f"{v:.{digits}f}"
    return str(v)


def table(result: dict[str, Any]) -> str:
    """The per-policy table and the ratio tables, as text."""
    pols = result["policies"]
    rows = [
        ("tokens", "tokens", 0), ("finished", "finished", 0), ("lost", "lost", 0),
        ("goodput req/s", "goodput_rps", 3),
        ("TTFT p50 s", "ttft_p50_s", 3), ("TTFT p95 s", "ttft_p95_s", 3), ("TTFT p99 s", "ttft_p99_s", 3),
        ("E2E p50 s", "e2e_p50_s", 2), ("E2E p95 s", "e2e_p95_s", 2), ("E2E p99 s", "e2e_p99_s", 2),
        ("worst 5-min P95 after change s", "worst_p95_after_event_s", 3), ("steady P95 s", "steady_p95_s", 3),
        ("switches", "switches", 0), ("cold restarts", "restarts", 0),
        ("switch s (median)", None, 2), ("change -> serving s (max)", None, 2),
        ("GPU memory util", "mem_util", 3), ("GPU compute util (MFU)", "compute_util", 3),
        ("GPU-hours held", "gpu_hours_held", 1),
        ("peak GPU memory booked", "peak_gpu_mem_fraction", 3), ("refused PREPAREs", "refused_prepares", 0),
    ]
    names = list(pols)
    width = max(16, *(len(n) + 2 for n in names))
    out = [f"{'':32}" + "".join(f"{n:>{width}}" for n in names)]
    for label, key, digits in rows:
        cells = []
        for n in names:
            r = pols[n]
            if label.startswith("switch s"):
                d = sorted(r["switch_durations_s"])
                v: Any = d[len(d) // 2] if d else None
            elif label.startswith("change"):
                w = r["event_to_serving_s"]
                v = None if not w else (None if any(x is None for x in w) else max(w))
                if w and any(x is None for x in w):
                    cells.append(f"{'never':>{width}}")
                    continue
            else:
                v = r[key]
            cells.append(f"{_f(v, digits) if isinstance(v, float) else _f(v):>{width}}")
        out.append(f"{label:32}" + "".join(cells))
    for ref, block in result["ratios"].items():
        out.append("")
        out.append(f"ratios {ref.replace('_', ' ')} (policy / {ref[3:]})")
        keys = list(next(iter(block.values())))
        out.append(f"{'':32}" + "".join(f"{n:>{width}}" for n in names))
        for k in keys:
            out.append(f"{k:32}" + "".join(f"{_f(block[n][k], 3):>{width}}" for n in names))
    t = result["targets"]
    lim = t["limits"]
    out.append("")
    out.append("targets (issue 4 sets them for paper.yaml; measured here, never asserted)")

    def line(label: str, value: Any, ok: bool | None) -> None:
        mark = "" if ok is None else ("  met" if ok else "  NOT met")
        out.append(f"  {label:58}{_f(value, 3):>10}{mark}")

    if "static_tokens_over_flexpipe" in t:
        v = t["static_tokens_over_flexpipe"]
        line(f"static tokens / flexpipe tokens <= {lim['static_tokens_over_flexpipe_max']}", v,
             v is not None and v <= lim["static_tokens_over_flexpipe_max"])
    if "flexpipe_tokens_over_oracle" in t:
        v = t["flexpipe_tokens_over_oracle"]
        line(f"flexpipe tokens / oracle tokens >= {lim['flexpipe_tokens_over_oracle_min']}", v,
             v is not None and v >= lim["flexpipe_tokens_over_oracle_min"])
    if "flexpipe_worst_over_steady_p95" in t:
        v = t["flexpipe_worst_over_steady_p95"]
        line(f"flexpipe worst-after-change / steady P95 <= {lim['flexpipe_worst_over_steady_p95_max']}", v,
             None if v is None else v <= lim["flexpipe_worst_over_steady_p95_max"])
    if "static_worst_over_steady_p95" in t:
        v = t["static_worst_over_steady_p95"]
        line(f"static worst-after-change / steady P95 >= {lim['static_worst_over_steady_p95_min']}", v,
             None if v is None else v >= lim["static_worst_over_steady_p95_min"])
    if "flexpipe_event_to_serving_max_s" in t:
        v = t["flexpipe_event_to_serving_max_s"]
        line(f"flexpipe change -> new gear serving <= {lim['event_to_serving_max_s']} s (max)", v,
             v <= lim["event_to_serving_max_s"] and not t["flexpipe_event_to_serving_unserved"])
    if "flexpipe_goodput_below" in t:
        below = t["flexpipe_goodput_below"]
        out.append(f"  {'flexpipe goodput >= every non-oracle policy':58}{'':>10}"
                   f"  {'met' if not below else 'NOT met (below: ' + ', '.join(below) + ')'}")
    lost = t["lost"]
    out.append(f"  {'requests lost by every policy == 0':58}{sum(lost.values()):>10}"
               f"  {'met' if not any(lost.values()) else 'NOT met'}")
    if "peak_gpu_mem_fraction" in t:  # issue 13: the paper targets hold under the real memory constraint
        peak = max(t["peak_gpu_mem_fraction"].values())
        line(f"peak GPU memory booked <= {lim['peak_gpu_mem_fraction_max']} (every policy)", peak,
             peak <= lim["peak_gpu_mem_fraction_max"])
    return "\n".join(out)


def html_report(result: dict[str, Any]) -> str:
    """A self-contained page: throughput and P95 over time per policy, changes marked, and
    FlexPipe's gear timeline (GPUs per deployment, shapes on hover)."""
    import plotly.graph_objects as go  # type: ignore[import-untyped]
    from plotly.subplots import make_subplots  # type: ignore[import-untyped]

    pols = result["policies"]
    palette = ("#636efa", "#00cc96", "#ffa15a", "#ef553b", "#ab63fa", "#19d3f3", "#ff6692")
    color = {name: palette[i % len(palette)] for i, name in enumerate(pols)}  # one per policy, every panel
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=("output tokens/s (per minute)", "TTFT P95 s by arrival minute (log)",
                                        "FlexPipe gear: GPUs per deployment"))
    for name, r in pols.items():
        bin_s = r["series"]["bin_s"]
        xs = [i * bin_s / 3600 for i in range(len(r["series"]["tokens_per_s"]))]
        fig.add_trace(go.Scatter(x=xs, y=r["series"]["tokens_per_s"], name=name, legendgroup=name,
                                 mode="lines", line={"color": color[name]}), row=1, col=1)
        fig.add_trace(go.Scatter(x=xs, y=r["series"]["ttft_p95_s"], name=name, legendgroup=name,
                                 mode="lines", line={"color": color[name]}, showlegend=False), row=2, col=1)
    flex = pols.get("flexpipe")
    if flex:
        by_dep: dict[str, list[tuple[float, int, str]]] = {}
        for t_s, dep, shape, gpus in flex["gear_timeline"]:
            by_dep.setdefault(dep, []).append((t_s, gpus, shape))
        end_h = result["duration_s"] / 3600
        for dep, pts in by_dep.items():
            xs = [p[0] / 3600 for p in pts] + [end_h]
            ys = [p[1] for p in pts] + [pts[-1][1]]
            text = [p[2] for p in pts] + [pts[-1][2]]
            fig.add_trace(go.Scatter(x=xs, y=ys, name=f"flexpipe {dep}", mode="lines+markers",
                                     line_shape="hv", text=text, hovertemplate="%{text}<br>%{y} GPUs",
                                     line={"dash": "solid" if dep == next(iter(by_dep)) else "dot"}),
                          row=3, col=1)
    for ev in result["events"]:
        x = ev["t_s"] / 3600
        for row in (1, 2, 3):
            fig.add_vline(x=x, line_width=1, line_dash="dot", line_color="gray", row=row, col=1)
        fig.add_annotation(x=x, y=1.0, yref="paper", text=f"{ev['kind']} {ev['node'] or ''}", showarrow=False,
                           textangle=-90, xanchor="left", yanchor="top", font={"size": 9})
    fig.update_yaxes(type="log", row=2, col=1)
    fig.update_xaxes(title_text="hours", row=3, col=1)
    fig.update_layout(height=1000, title=f"FlexPipe replay: {result['scenario']} (seed {result['seed']},"
                                         f" {result['requests']} requests)")
    summary = "<pre>" + table(result).replace("&", "&amp;").replace("<", "&lt;") + "</pre>"
    page = str(fig.to_html(include_plotlyjs=True, full_html=True))
    return page.replace("<body>", "<body>\n" + summary, 1)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.split("\n")[0])
    parser.add_argument("scenario", help="scenario YAML (docs/scenarios.md)")
    parser.add_argument("--policies", default=",".join(ALL_POLICIES),
                        help=f"comma-separated, any of {', '.join(ALL_POLICIES)} (default: all)")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--html", help="write the plotly report here")
    parser.add_argument("--no-timing", action="store_true", help="leave wall_s/cpu_s out of the JSON")
    parser.add_argument("--pin-cpu", action="store_true", help="run on one CPU core")
    parser.add_argument("--no-trend", action="store_true",
                        help="flexpipe plans for the load's level alone (GearboxConfig.trend off)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    names: Sequence[str] = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        for name in names:
            make_policy(name)
    except ValueError as exc:
        print(f"--policies: {exc}", file=sys.stderr)
        return 2
    if not names:
        print("--policies: name at least one policy", file=sys.stderr)
        return 2
    try:
        scenario = load_scenario(args.scenario)
    except SchemaError as exc:
        print(f"{args.scenario}:", file=sys.stderr)
        for path, reason in exc.errors.items():
            print(f"  {path}: {reason}", file=sys.stderr)
        return 2
    if args.pin_cpu and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    timings: dict[str, dict[str, float]] = {}
    wall0, cpu0 = time.perf_counter(), time.process_time()
    last = [wall0, cpu0]

    def done(name: str, r: dict[str, Any]) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        timings[name] = {"wall_s": round(wall - last[0], 3), "cpu_s": round(cpu - last[1], 3)}
        last[0], last[1] = wall, cpu
        print(f"  {name:16} done: {r['finished']} finished, {r['tokens']} tokens"
              f" ({timings[name]['wall_s']:.1f} s wall, {timings[name]['cpu_s']:.1f} s CPU)", file=sys.stderr)

    print(f"replaying {scenario.name} ({scenario.duration_s / 3600:.2f} h simulated) under {', '.join(names)}",
          file=sys.stderr)
    try:
        options = PolicyOptions(gearbox=replace(DEFAULT_CONFIG, trend=False)) if args.no_trend else PolicyOptions()
        result = replay(scenario, names, policy_options=options, on_policy=done)
    except ValueError as exc:
        print(f"{args.scenario}: {exc}", file=sys.stderr)
        return 2
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    print(table(result))
    print(f"\nwhole run: {wall:.1f} s wall, {cpu:.1f} s CPU"
          f"{' (pinned to one core)' if args.pin_cpu else ''}; {result['requests']} requests per policy")
    if not args.no_timing:
        result["wall_s"] = round(wall, 3)
        result["cpu_s"] = round(cpu, 3)
        result["timing_per_policy"] = timings
    if args.json:
        Path(args.json).write_text(to_json(result))
        print(f"wrote {args.json}")
    if args.html:
        Path(args.html).write_text(html_report(result))
        print(f"wrote {args.html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
