"""Priority across the pool: which lower-priority holder gives which GPUs to a higher one.

The control loop decides deployments highest priority first (scheduler.control.loop). When a
deployment cannot meet its SLOs on the GPUs left to it - its current gear does not stand and no
candidate the gearbox weighed does - it may take GPUs from holders of lower priority: other
deployments now, fine-tune and batch jobs (priority 1, seed 004 section 5.2) as they come. The
giver yields through a transition of its own (it decides again with those GPUs kept from it: it
shrinks, or moves elsewhere) - so what it serves is handed over, never dropped - and the taker
switches onto them once they are released. Both sides' decisions name the other (audited).

`choose_givers` is the rule, free of what a holder is:

* only holders of strictly lower priority that may yield now (`Holder.can_yield`: not in a
  transition of their own, not pinned by an operator, not being deleted) are asked;
* the lowest priority gives first (then the fewest GPUs, then the name): holders are released
  one more at a time and the taker's plan is tried on what is free plus what they hold
  (`try_with`, the caller's: the gearbox on that snapshot, a standing target or None);
* the first set that lets the taker stand wins, and each released holder gives only the GPUs of
  that target it holds (a holder whose GPUs the target does not use gives nothing);
* a giver that has nowhere to go - no gear of it fits on what is left - unloads (seed 004's "hot
  unload"; `Takeover.unload_reason`): the loop releases its gear as scale to zero does, and it
  comes back when GPUs fit it again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from scheduler.plan import Gear

# How long a giver that unloaded keeps off the GPUs it gave (the loop's `keep_off`): long enough for
# its drain (FLEXPIPE_DRAIN_BUDGET_S, 10 s by default) and the taker's switch onto them, a back-off
# after a refusal included (scheduler/backoff.py: 30 s, doubling); after it, GPUs the taker did not
# take are anyone's again.
UNLOAD_HOLD_S = 300.0


@dataclass(frozen=True)
class Holder:
    """Someone holding GPUs of the pool."""

    id: str  # a deployment's (or a job's) name
    priority: int  # higher wins
    gpus: frozenset[str]  # the GPUs it holds now
    can_yield: bool = True  # it may give GPUs now (no transition running, not pinned, not deleting)
    kind: str = "deployment"  # deployment | job


@dataclass(frozen=True)
class Give:
    """GPUs one holder gives."""

    giver: str
    giver_priority: int
    gpus: tuple[str, ...]  # sorted
    kind: str = "deployment"


@dataclass(frozen=True)
class Takeover:
    """A higher-priority deployment taking GPUs from lower ones."""

    taker: str
    taker_priority: int
    target: Gear  # the gear it stands on once the GPUs are released
    gives: tuple[Give, ...]  # who gives what, lowest priority first

    @property
    def gpus(self) -> frozenset[str]:
        return frozenset(u for g in self.gives for u in g.gpus)

    def taker_reason(self) -> str:
        parts = "; ".join(f"{len(g.gpus)} GPU(s) from {g.kind} {g.giver} (priority {g.giver_priority})"
                          f" [{', '.join(g.gpus)}]" for g in self.gives)
        return (f"priority {self.taker_priority}: cannot meet its SLOs on the GPUs left to it; takes {parts};"
                f" it switches to {self.target.shape()} once they are released")

    def given_by(self, giver: str) -> tuple[str, ...]:
        return next((x.gpus for x in self.gives if x.giver == giver), ())

    def giver_reason(self, giver: str) -> str:
        g = next(x for x in self.gives if x.giver == giver)
        return (f"gives {len(g.gpus)} GPU(s) [{', '.join(g.gpus)}] to deployment {self.taker} (priority"
                f" {self.taker_priority} > {g.giver_priority}), which cannot meet its SLOs without them")

    def unload_reason(self, giver: str) -> str:
        """Why `giver`, with no gear that fits on what is left to it, releases its gear instead."""
        return (f"unloads: {self.giver_reason(giver)}, and no gear of it fits on what is left; it releases"
                " its gear, and its requests wait until GPUs fit it again")


def choose_givers(taker: str, taker_priority: int, holders: Iterable[Holder],
                  try_with: Callable[[tuple[Holder, ...]], Gear | None]) -> Takeover | None:
    """Who gives which GPUs so that `taker` stands (module docstring); None: nobody can help."""
    asked = sorted((h for h in holders if h.id != taker and h.priority < taker_priority and h.can_yield and h.gpus),
                   key=lambda h: (h.priority, len(h.gpus), h.id))
    for n in range(1, len(asked) + 1):
        released = tuple(asked[:n])
        target = try_with(released)
        if target is None:
            continue
        want = set(target.gpu_uuids)
        gives = tuple(Give(h.id, h.priority, tuple(sorted(want & h.gpus)), h.kind) for h in released
                      if want & h.gpus)
        if not gives:
            return None  # it stands without anyone's GPUs: nothing to take (the caller's decision said otherwise)
        return Takeover(taker, taker_priority, target, gives)
    return None


__all__ = ["UNLOAD_HOLD_S", "Give", "Holder", "Takeover", "choose_givers"]
