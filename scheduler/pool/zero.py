"""Scale to zero and wake up (issue 17 deliverable 4): when an idle deployment gives its GPUs back.

`idle_signal(window, now_s, ...)` -> IdleSignal(release, reason): `release` when the deployment's
load window shows no arrivals and no backlog for longer than its `idle_to_zero_s`. The control
loop reads it as its rule 9b (scheduler/control/loop.py); its drivers carry a release out by
draining the gear (nothing admitted is lost) and freeing its GPUs. A deployment at zero comes back
through the loop's rule 9 (the baseline's bring-up) as soon as its driver sees a request held for
it: the gateway's cold-start wait, or the simulator's deployment queue.

What counts as idle - the rule holds unless all of these are true:
  * it may scale to zero: `idle_to_zero_s` set, `min_replicas` 0, and mode auto (a pinned or
    emergency deployment holds its gear, operators win; an advisory one acts on nothing itself);
  * the window is not silent: its newest sample is within `fresh_s` of now (missing telemetry is
    not zero load, as autoscale.scale_signal holds on silence too);
  * the quiet span - from the later of the newest sample with arrivals or backlog, and the moment
    the current gear came up (`up_since_s`: a gear that just woke has not served its first request
    yet; without it the window's first sample) - has reached `idle_to_zero_s`.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.gearbox import LoadWindow, Mode


@dataclass(frozen=True)
class IdleSignal:
    release: bool  # scale to zero now
    reason: str
    quiet_s: float | None = None  # how long the window shows no arrivals (None: unknown)


def quiet_since_s(window: LoadWindow, up_since_s: float | None = None) -> float | None:
    """Since when the window shows no arrivals and no backlog (None: no samples)."""
    if not window.samples:
        return None
    busy = [s.t_s for s in window.samples if s.rate_rps > 0 or s.backlog > 0]
    since = busy[-1] if busy else window.samples[0].t_s
    return max(since, up_since_s) if up_since_s is not None else since


def never_to_zero(idle_to_zero_s: float | None, min_replicas: int, mode: Mode) -> str | None:
    """Why this deployment may not rest at zero (None: it may). A deployment at zero that may not
    any more - an operator set min_replicas 1, or cleared its idle time - comes back up."""
    if idle_to_zero_s is None:
        return "idle_to_zero_s is not set: never scaled to zero"
    if min_replicas != 0:
        return f"min_replicas is {min_replicas}: never scaled to zero"
    if mode is not Mode.AUTO:
        return f"{mode.value}: never scaled to zero automatically"
    return None


def idle_signal(window: LoadWindow, now_s: float, *, idle_to_zero_s: float | None, min_replicas: int, mode: Mode,
                up_since_s: float | None = None, fresh_s: float = 60.0) -> IdleSignal:
    """Whether the deployment should scale to zero now (module docstring)."""
    why_not = never_to_zero(idle_to_zero_s, min_replicas, mode)
    if why_not is not None or idle_to_zero_s is None:
        return IdleSignal(False, why_not or "")
    since = quiet_since_s(window, up_since_s)
    if since is None or window.samples[-1].t_s < now_s - fresh_s:
        return IdleSignal(False, f"no load sample in the last {fresh_s:g} s: silence is not idleness")
    quiet = now_s - since
    if quiet < idle_to_zero_s:
        return IdleSignal(False, f"no arrivals for {quiet:.0f} s of the {idle_to_zero_s:g} s idle time", quiet)
    return IdleSignal(True, f"no arrivals for {quiet:.0f} s, its idle time ({idle_to_zero_s:g} s) is up: "
                            "scale to zero", quiet)


def wake_reason(waiting: int) -> str:
    if waiting <= 0:
        return "scaled to zero, but it may not rest there any more: bring the baseline gear up"
    return f"scaled to zero with {waiting} request(s) held: wake up, bring the baseline gear up"


__all__ = ["IdleSignal", "idle_signal", "never_to_zero", "quiet_since_s", "wake_reason"]
