"""Token-weighted utilisation as the pages and /metrics show it (the definition: scheduler/pool/twu.py).

`twu_view(deployments, fleet, active)` reads what is already stored - the engines' latest reports
(FleetView.engines: tokens_per_s, arrivals, prompt_tokens_mean, output_tokens_mean), each node's
report interval (the window those counts cover, as `snapshot.load_sample` reads it) and the
snapshot the FleetView was built on - and prices each plan of each deployment's current gear (and
of its running transition's target, whose shadow plans serve canary traffic) with the cost model
under the request shape its engines report (the deployment's load window, then 512/128 tokens,
where they report none). A plan whose GPUs are not in the snapshot, or whose model has no spec,
has no TWU (unknown, not 0), and neither has a plan without reports.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.utils import timezone

from console.gearbox.models import Deployment, Transition
from scheduler.costmodel import PlanProfile, Workload
from scheduler.gearbox import DEFAULT_CONFIG
from scheduler.plan import Plan
from scheduler.pool.twu import PlanTokens, PlanTwu, TokenCosts, deployment_twu, gpu_twu, plan_twu
from scheduler.topology import Snapshot

log = logging.getLogger(__name__)

DEFAULT_SHAPE = (512.0, 128.0)  # prompt / output tokens where nothing says (snapshot.load_sample's defaults)
MAX_MEAN_TOKENS = 10_000_000.0  # a mean length beyond any context window is a broken report, not a shape


@dataclass
class TwuView:
    """TWU of the deployments' plans over their engines' latest report intervals."""

    plans: dict[str, PlanTwu] = field(default_factory=dict)  # plan id -> its TWU
    gpus: dict[str, float] = field(default_factory=dict)  # GPU uuid -> its TWU (plans on it summed)
    deployments: dict[int, float | None] = field(default_factory=dict)  # deployment pk -> TWU (None: no reports)
    plans_of: dict[int, list[str]] = field(default_factory=dict)  # deployment pk -> its plans' ids

    def payload(self, dep: Deployment) -> dict[str, Any] | None:
        """The deployment page's TWU: its value and its plans' (None: it runs nothing yet)."""
        ids = self.plans_of.get(dep.pk)
        if ids is None:
            return None
        value = self.deployments.get(dep.pk)
        return {"value": None if value is None else round(value, 4), "plans": [
            {"plan_id": p, **({"twu": round(t.twu, 4), "prefill": round(t.prefill, 4), "decode": round(t.decode, 4)}
                              if (t := self.plans.get(p)) is not None else {"twu": None})} for p in ids]}

    def gpu_payload(self) -> dict[str, float]:
        return {u: round(v, 4) for u, v in self.gpus.items()}


def twu_view(deployments: Sequence[Deployment], engines: Mapping[str, list[dict[str, Any]]],
             snapshot: Snapshot | None, active: Mapping[int, Transition], now: datetime | None = None) -> TwuView:
    """TWU per plan, per GPU and per deployment (module docstring). `engines`: FleetView.engines."""
    from console.gearbox.present import parse_gear
    from console.gearbox.snapshot import load_window, report_intervals_s
    from console.registry.specs import spec_for

    now = now or timezone.now()
    view = TwuView()
    windows = report_intervals_s({str(r.get("node")) for reports in engines.values() for r in reports})
    for dep in deployments:
        plans: dict[str, Plan] = {}
        t = active.get(dep.pk)
        for raw in (dep.current_gear, t.to_gear if t is not None else None):
            gear = parse_gear(raw)
            for plan in gear.plans if gear is not None else ():
                plans.setdefault(plan.plan_id, plan)
        if not plans:
            continue
        view.plans_of[dep.pk] = list(plans)
        try:
            spec = spec_for(dep)
        except ValueError:
            spec = None
        fallback = load_window(dep.load_window).over(now.timestamp(), DEFAULT_CONFIG.long_window_s)
        values: list[PlanTwu | None] = []
        for plan_id, plan in plans.items():
            reports = engines.get(plan_id, [])
            window_s = max((windows.get(str(r.get("node")), 0.0) for r in reports), default=0.0)
            twu = None
            try:  # (reports whose counts overflow, a GPU no longer in the snapshot: unknown, not an error page)
                tokens = PlanTokens.from_reports(plan_id, reports, window_s) if window_s > 0 else None
                if tokens is not None and spec is not None and snapshot is not None:
                    profile = PlanProfile.build(plan, spec, snapshot)
                    twu = plan_twu(plan, TokenCosts.of(profile, _shape(reports, fallback)), tokens)
            except (ValueError, KeyError, OverflowError) as exc:
                log.debug("twu: plan %s of %s not priced: %s", plan_id, dep.name, exc)
            if twu is not None:
                view.plans[plan_id] = twu
            values.append(twu)
        view.deployments[dep.pk] = deployment_twu(values)
    view.gpus = gpu_twu(view.plans.values())
    return view


def _shape(reports: Sequence[Mapping[str, Any]], fallback: Workload | None) -> Workload:
    """The request shape the engines report (prompts weighted by arrivals, outputs by finished)."""
    prompt_w = prompt = output_w = output = 0.0
    for r in reports:
        n, f = _count(r.get("arrivals")), _count(r.get("finished"))
        p, o = r.get("prompt_tokens_mean"), r.get("output_tokens_mean")
        if n and isinstance(p, int | float) and 1 <= p <= MAX_MEAN_TOKENS:
            prompt_w, prompt = prompt_w + n, prompt + n * float(p)
        if f and isinstance(o, int | float) and 1 <= o <= MAX_MEAN_TOKENS:
            output_w, output = output_w + f, output + f * float(o)
    base_p, base_o = ((fallback.prompt_tokens_mean, fallback.output_tokens_mean) if fallback is not None
                      else DEFAULT_SHAPE)
    return Workload(0.0, prompt / prompt_w if prompt_w else base_p, output / output_w if output_w else base_o)


def _count(value: object) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else 0.0




__all__ = ["TwuView", "twu_view"]
