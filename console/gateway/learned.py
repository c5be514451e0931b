"""Routing weights that learn, in the gateway (issue 16 deliverable 4; the rules are
scheduler/router/learning.py's, the policy scheduler/router/learned.py's).

`FLEXPIPE_ROUTER_POLICY`: "flexpipe" (the default: the router's configured weights),
"flexpipe+learned", or "flexpipe+budget" (the configured weights with KV spillover and its
timeout: console/gateway/routing.py). With the learned policy every deployment gets its own LearnedRouter in each
gateway process: a cold start on round-robin, then 10% -> 50% -> 100% of its requests (a 5%
control stays on round-robin), rolled back when the learned arm's SLA-violation rate passes
round-robin's x 1.05 over a window, back on round-robin for a while after an anomaly (an arrival
jump, or the deployment's plans changing). `FLEXPIPE_ROUTER_ROLLOUT` overrides
`RolloutConfig`'s fields (a dict; every bad key or value named at start-up, `rollout_config`).

What it learns from: the gateway's own measurements of each request it routed - TTFT from
admission to the first token, TPOT over the rest - held to the deployment's SLO (`ttft_ms`,
`tpot_ms`). A request that ended in a server error without a token counts as a violation; one
the client gave up on before its first token counts as nothing (no latency was observed).

Per process: each gateway process learns from, and rolls out over, the requests it routes itself
(several processes are several independent rollouts: each stage change names its process).

Every stage change is, written off the request path,
* an audit entry `router.rollout` (the deployment, before -> after stage, the learned share, the
  reason, both violation rates, the process);
* the deployment's newest changes in Redis (`flexpipe:router:rollout:<name>`), which the
  Deployment page shows (`recent`) and /metrics exports from whichever process serves the scrape
  (console/metrics/gearbox.py, `newest`): `flexpipe_router_rollout_share{deployment}` (the learned
  arm's share) and `flexpipe_router_rollback_active{deployment}` (1 while rolled back: the alert
  rule reads it). With several gateway processes these follow the newest change of any of them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from django.conf import settings

from console.gateway import decisions
from scheduler.router import RouterConfig
from scheduler.router.learned import LearnedRouter
from scheduler.router.learning import RolloutConfig, StageChange

log = logging.getLogger(__name__)

POLICIES = ("flexpipe", "flexpipe+learned", "flexpipe+budget")
clock: Callable[[], float] = time.monotonic  # the rollout's time (tests step it)
KEEP = 10  # stage changes kept per deployment for the page
PREFIX = "flexpipe:router:rollout:"
AUDIT_EVENT = "router.rollout"



def policy_name() -> str:
    name = str(getattr(settings, "FLEXPIPE_ROUTER_POLICY", "flexpipe") or "flexpipe")
    if name not in POLICIES:
        raise ValueError(f"FLEXPIPE_ROUTER_POLICY: unknown {name!r}; known: {', '.join(POLICIES)}")
    return name


def enabled() -> bool:
    return policy_name() == "flexpipe+learned"


def rollout_config(raw: object = None) -> RolloutConfig:
    """RolloutConfig from FLEXPIPE_ROUTER_ROLLOUT (a dict of its fields; None: the defaults)."""
    raw = getattr(settings, "FLEXPIPE_ROUTER_ROLLOUT", None) if raw is None else raw
    if isinstance(raw, str):  # from the environment
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"FLEXPIPE_ROUTER_ROLLOUT: not JSON ({exc})") from None
    if raw in (None, {}):
        return RolloutConfig()
    if not isinstance(raw, Mapping):
        raise ValueError(f"FLEXPIPE_ROUTER_ROLLOUT: must be an object of RolloutConfig fields; got {raw!r}")
    known = [f.name for f in fields(RolloutConfig)]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise ValueError(f"FLEXPIPE_ROUTER_ROLLOUT.{key}: unknown field; known: {', '.join(known)}")
        if key == "shares":
            if not isinstance(value, list | tuple) or not all(_number(v) for v in value):
                raise ValueError(f"FLEXPIPE_ROUTER_ROLLOUT.shares: must be a list of numbers; got {value!r}")
            kwargs[key] = tuple(float(v) for v in value)
        elif not _number(value):
            raise ValueError(f"FLEXPIPE_ROUTER_ROLLOUT.{key}: must be a number; got {value!r}")
        else:
            default = getattr(_DEFAULTS, key)
            if isinstance(default, int) and value != int(value):
                raise ValueError(f"FLEXPIPE_ROUTER_ROLLOUT.{key}: must be a whole number; got {value!r}")
            kwargs[key] = int(value) if isinstance(default, int) else float(value)
    try:
        return RolloutConfig(**kwargs)
    except ValueError as exc:
        raise ValueError(f"FLEXPIPE_ROUTER_ROLLOUT.{exc}") from None


_DEFAULTS = RolloutConfig()


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


# -- one learned router per deployment, in this process ------------------------------------------------

_lock = threading.Lock()
_routers: dict[str, LearnedRouter] = {}
_seen: dict[str, int] = {}  # deployment -> stage changes already published


def policy_for(deployment: str, slo_s: tuple[float, float], config: RouterConfig, seed: int) -> LearnedRouter:
    """The deployment's learned router (made on its first request; its SLO follows the deployment's)."""
    with _lock:
        lr = _routers.get(deployment)
        if lr is None:
            import random

            lr = _routers[deployment] = LearnedRouter(config, rng=random.Random(f"{seed}:{deployment}"),
                                                      rollout=rollout_config(), start_s=clock())
            _seen[deployment] = 0
        ttft, tpot = slo_s
        lr.slo = lambda prompt, output: (ttft, tpot)
        return lr


def reset() -> None:
    with _lock:
        _routers.clear()
        _seen.clear()


def publish(deployment: str, lr: LearnedRouter) -> list[StageChange]:
    """Carry out the stage changes since the last call (module docstring): gauges now, audit and
    Redis on a thread of their own. Returns them (tests)."""
    with _lock:
        start = _seen.get(deployment, 0)
        new = list(lr.controller.events[start:])
        _seen[deployment] = start + len(new)
    if not new:
        return []
    rows = [change_payload(c) for c in new]
    soon(_record, deployment, rows)
    return new


def soon(fn: Callable[..., None], *args: Any) -> None:
    """Run `fn` on a thread of its own: the request never waits on the database or Redis (tests run it inline)."""
    threading.Thread(target=fn, args=args, name="router-rollout", daemon=True).start()


def change_payload(c: StageChange) -> dict[str, Any]:
    at = datetime.now(UTC) - timedelta(seconds=max(0.0, clock() - c.at_s))  # at_s: the rollout's clock
    return {"at": at.isoformat(), "before": str(c.before), "after": str(c.after), "share": round(c.share, 4),
            "reason": c.reason, "learned_violation_rate": c.learned_violation_rate,
            "rr_violation_rate": c.rr_violation_rate, "process": PROCESS}


PROCESS = f"{socket.gethostname()}:{os.getpid()}"


def summary(deployment: str, row: Mapping[str, Any]) -> str:
    rates = ""
    if row["learned_violation_rate"] is not None and row["rr_violation_rate"] is not None:
        rates = (f" (SLA violations: learned {row['learned_violation_rate']:.1%}, "
                 f"round-robin {row['rr_violation_rate']:.1%})")
    return (f"learned routing of {deployment}: {row['before']} -> {row['after']}, "
            f"{row['share']:.0%} of requests{rates}")


def _record(deployment: str, rows: list[dict[str, Any]]) -> None:
    """Audit each change and keep the newest for the page (errors logged: the request never waits)."""
    from django.db import close_old_connections

    from console.audit.chain import actor_of, record

    try:
        for row in rows:
            record(AUDIT_EVENT, actor=actor_of(system="gateway"), summary=summary(deployment, row),
                   at=datetime.fromisoformat(row["at"]), deployment=deployment, data=row,
                   before={"stage": row["before"]}, after={"stage": row["after"], "share": row["share"]})
    except Exception:  # the database away: the page, /metrics and the log still say it
        log.exception("router rollout: cannot audit %s's stage change", deployment)
    finally:
        close_old_connections()
    keep(deployment, rows)


def keep(deployment: str, rows: list[dict[str, Any]]) -> None:
    """The newest stage changes, for the Deployment page and /metrics (a capped Redis list)."""
    decisions.push_capped(PREFIX + deployment, rows, KEEP)


def newest(deployments: list[str]) -> dict[str, dict[str, Any]]:
    """deployment -> its newest stage change, for those that have one (one Redis round trip; {} when away)."""
    try:
        pipe = decisions._client().pipeline()
        for name in deployments:
            pipe.lindex(PREFIX + name, 0)
        raw = pipe.execute()
    except (OSError, redis.RedisError) as exc:
        log.warning("router rollout: cannot read the stages: %s", exc)
        return {}
    out = {}
    for name, item in zip(deployments, raw, strict=True):
        try:
            out[name] = json.loads(item) if item else None
        except ValueError:
            continue
    return {k: v for k, v in out.items() if isinstance(v, dict)}


def recent(deployment: str, n: int = 5) -> list[dict[str, Any]]:
    """The newest stage changes of the deployment's learned routing, newest first ([] off or Redis away)."""
    return decisions.newest_of(PREFIX + deployment, n)


__all__ = ["AUDIT_EVENT", "POLICIES", "enabled", "policy_for", "policy_name", "publish", "recent", "reset",
           "rollout_config"]
