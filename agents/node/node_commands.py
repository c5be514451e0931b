"""The node commands of a node agent (agents/protocol/: verify_weights, probe_links,
apply_hints) and their side in each main-loop pass: hints that lapse, links probed again.

NodeCommands is a mixin of NodeAgent (agents/node/daemon.py): the daemon pulls each command once,
checks its payload, calls the handler here and acks its outcome. The attributes the class declares
are the agent's, set by its __init__.

Invariants:
- Node commands (verify_weights, probe_links, apply_hints) run outside every plan lock: they name
  no plan lock's key. apply_hints (scheduler/control/correction.py) keeps the hints in the node's
  HintBook and sets the batch-token threshold of each plan it leads whose engine has one (the
  torch engine: tokens per step; a vLLM server fixes max_num_batched_tokens when it starts, so its
  plans are listed `unknown`); each main-loop pass (`step`) returns an engine whose hint lapsed
  to its own threshold. The weight multiplier is the router's, not the node's: nothing here. Links to the peers `probe_links` named are probed again every FLEXPIPE_LINK_PROBE_S
  (agents/node/links.py) and every report carries the latest figure per peer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agents.node.links import LinkProber
from agents.node.plans import Backend, ModelStore
from agents.node.state import NodeState, PlanSlot, _Outcome
from scheduler.control.correction import HintBook, hints_from_payload
from scheduler.refusal import Refused

log = logging.getLogger("agents.node")


class NodeCommands:
    """The handlers of the node commands and their periodic side (module docstring)."""

    node_id: str
    backend: Backend | None
    backend_name: str
    links: LinkProber
    clock: Callable[[], float]
    state: NodeState
    plans: dict[tuple[str, str], PlanSlot]
    hints: HintBook
    _hinted: set[tuple[str, str]]
    _lock: threading.Lock
    _pool: ThreadPoolExecutor

    def _verify_weights(self, p: dict[str, Any]) -> _Outcome:
        """verify_weights: hash the weights this node holds for model `name` (agents/protocol/).

        Ok with the digest whether or not it is the registry's (the console decides: verified or
        quarantined); failed when this node holds no such weights, naming the model and the folder.
        """
        name = str(p["name"])
        store = getattr(self.backend, "models", None)
        if not isinstance(store, ModelStore):
            raise Refused(f"model {name!r}: node {self.node_id} holds no model store (backend "
                          f"{self.backend_name}), so it has no weights to hash")
        weights, digest = store.hash_held(name)
        same = "the registry's" if digest == p["sha256"] else f"not the registry's {str(p['sha256'])[:16]}..."
        return _Outcome("ok", f"model {name!r}: {weights} has sha256 {digest[:16]}..., {same}", {"sha256": digest})

    def _probe_links(self, p: dict[str, Any]) -> _Outcome:
        """probe_links: measure the named peers now and keep probing them (agents/node/links.py)."""
        peers = {str(n): str(a) for n, a in dict(p["peers"]).items() if str(n) != self.node_id}
        self.links.tell(peers)
        if p.get("bulk_bytes"):
            self.links.bulk_bytes = int(p["bulk_bytes"])
        measured = self.links.probe()
        self.state.dirty = True  # the new figures go out with the next report at once
        detail = ", ".join(f"{r.peer} {r.bw_gbps:.2f} Gb/s" for r in measured) or "no peer answered"
        return _Outcome("ok", f"links measured: {detail}",
                        {"links": [{k: v for k, v in r.__dict__.items() if v is not None} for r in measured]})

    def _apply_hints(self, p: dict[str, Any]) -> _Outcome:
        """apply_hints: hold the hints; set each led plan's threshold where its engine has one."""
        deployment, version, ttl_s, hints = hints_from_payload(p)
        with self._lock:
            if not self.hints.apply(deployment, version, ttl_s, hints, self.clock()):
                held = self.hints.versions[deployment]
                return _Outcome("ok", f"hints {version} of {deployment} ignored: {held} is newer",
                                {"applied": False, "hints_version": held, "plans": [], "unknown": []})
            slots = {h.plan_id: self.plans.get((deployment, h.plan_id)) for h in hints}
            self._hinted.update((deployment, h.plan_id) for h in hints if slots[h.plan_id] is not None)
        took, unknown, why = [], [], []
        for h in hints:
            slot = slots[h.plan_id]
            setter = getattr(slot.engine, "set_batch_scale", None) if slot is not None else None
            if slot is None or slot.role != "leader" or setter is None:
                unknown.append(h.plan_id)
                if slot is not None and slot.role == "leader":
                    why.append(f"{h.plan_id}: its engine sets its batch threshold when it starts")
                continue
            setter(h.batch_scale)
            took.append(h.plan_id)
        detail = "; ".join([f"hints {version} of {deployment}: {len(took)} plan(s)", *why])
        return _Outcome("ok", detail, {"applied": True, "hints_version": version, "plans": took, "unknown": unknown})

    def _lapse_hints(self) -> None:
        """The local side of a global loop that went quiet: an engine whose hint lapsed goes back
        to its own threshold."""
        now = self.clock()
        with self._lock:
            lapsed = [k for k in self._hinted if self.hints.live(k[0], k[1], now) is None]
            self._hinted.difference_update(lapsed)
            slots = [self.plans.get(k) for k in lapsed]
        for slot in slots:
            setter = getattr(slot.engine, "set_batch_scale", None) if slot is not None else None
            if setter is not None:
                setter(None)

    def _reprobe(self) -> None:
        """The periodic link probe (FLEXPIPE_LINK_PROBE_S), on the command pool: never in the way of
        reports or commands."""
        def run() -> None:
            try:
                self.links.probe()
                self.state.dirty = True
            except Exception:  # noqa: BLE001 - a failed round must not kill the pool thread
                log.exception("%s: the periodic link probe failed", self.node_id)

        try:
            self._pool.submit(run)
        except RuntimeError:  # the pool is shut down: the agent is closing
            pass


__all__ = ["NodeCommands"]
