"""Websockets of the gearbox pages: what they send on connect, and what each committed change pushes.

    /ws/gearbox/                the Overview's gearbox part and the Deployments list (viewers)
    /ws/deployments/<name>/     one deployment: its page and its decision / transition reviews (viewers)

The Overview's socket listens to three groups, each fed from `transaction.on_commit` only (what
they read is stored): "gearbox" (console.gearbox.live: transition steps and phases, routing
commits, decisions), "cluster" (console.fleet.live: agents' reports - GPUs, blocks, engine
metrics) and "audit" (the operator verbs that push nothing of their own: mode, pin, unpin,
emergency request, approval). A deployment's socket listens to its deployment's group only, where
the same pushes arrive when they concern it (console.dashboard.groups: per-page subscriptions). Each event makes the
consumer read the current state and send it, so a page never applies a change out of order. Fleet
reports come in far faster than a page needs them: they are coalesced per socket, at most one push
every FLEXPIPE_PUSH_MIN_INTERVAL_S, the last state always sent (console/dashboard/coalesce.py).

Messages (JSON, "type" first):
    snapshot      on connect and on {"type": "resync"}: the whole state (present.overview_state /
                  present.deployment_state)
    deployments   /ws/gearbox/: every deployment's payload, which GPUs each holds and each GPU's TWU
                  (after a report only when it differs from what the socket last got)
    fleet         /ws/gearbox/: atomic blocks and left-out GPUs, after a report that changed what the
                  page draws of them (`fleet_shape`; a block's free memory alone is not sent)
    switch        /ws/gearbox/: one transition (summary), as it moves
    deployment    /ws/deployments/<name>/: the deployment and the gears its page draws
    transition    /ws/deployments/<name>/: one of its transitions, with steps (present.transition_detail)
    decision      /ws/deployments/<name>/: one of its decisions, with candidates (present.decision_detail)
Close code 4404: no such deployment (after the role check: 4401 / 4403 as on every live page).
"""

from __future__ import annotations

import time
from typing import Any

from channels.db import database_sync_to_async

from console.audit.live import AUDIT_GROUP
from console.dashboard.coalesce import Coalescer, Shared
from console.dashboard.consumers import LiveConsumer
from console.dashboard.groups import deployment_group
from console.fleet.live import CLUSTER_GROUP
from console.gearbox import present
from console.gearbox.live import GEARBOX_GROUP, OPERATOR_EVENTS
from console.gearbox.models import Deployment

FLEET_PUSH_BUSY_SHARE = 0.25  # the Overview's fleet view takes at most this share of the process per socket
# The fleet view, built once for every Overview and deployment socket of the process that needs one (coalesce.Shared)
FLEET_VIEW: Shared[present.FleetView] = Shared(database_sync_to_async(present.fleet_view))

class _GearboxLive(LiveConsumer):
    """A live page that also hears fleet reports and operator verbs (module docstring)."""

    group = GEARBOX_GROUP
    also: tuple[str, ...] = (CLUSTER_GROUP, AUDIT_GROUP)
    _joined = False

    async def join_all(self) -> None:
        # Joined before the first state is read: nothing committed after that read goes unheard.
        if not self._joined:
            for group in self.also:
                await self.channel_layer.group_add(group, self.channel_name)
            self._joined = True

    async def leave_groups(self) -> None:
        if self._joined:
            self._joined = False
            for group in self.also:
                await self.channel_layer.group_discard(group, self.channel_name)
        await super().leave_groups()


class GearboxConsumer(_GearboxLive):
    page = "gearbox"

    # what this socket last got of the fleet (fleet_shape) and of the deployments: a fleet push sends
    # only what changed since (issue 19: what the page draws, not the whole fleet at every report)
    _fleet_shape: Any = None
    _deployments: dict[str, Any] | None = None

    async def on_accepted(self) -> None:
        await self.join_all()
        snap = await database_sync_to_async(present.overview_state)()
        self._fleet_shape = fleet_shape(snap)
        self._deployments = {k: snap[k] for k in ("deployments", "holders", "gpu_twu")}
        await self.send_json({"type": "snapshot", **snap})

    async def _send_deployments(self, state: dict[str, Any], *, always: bool = True) -> None:
        if always or state != self._deployments:
            self._deployments = state
            await self.send_json({"type": "deployments", **state})

    async def gearbox_event(self, event: dict[str, Any]) -> None:
        ev = event["event"]
        await self._send_deployments(await database_sync_to_async(present.deployments_state)())
        if ev.get("kind") == "transition":
            switch = await database_sync_to_async(_switch)(ev["deployment"], ev["seq"])
            if switch is not None:
                await self.send_json({"type": "switch", "transition": switch})

    _fleet_push: Coalescer | None = None

    async def cluster_delta(self, event: dict[str, Any]) -> None:
        # The fleet view is the whole fleet: built once per FLEXPIPE_PUSH_MIN_INTERVAL_S, not per report.
        if self._fleet_push is None:
            self._fleet_push = self.coalesced(self._send_fleet, busy_share=FLEET_PUSH_BUSY_SHARE)
        self._fleet_push.poke()

    async def _send_fleet(self) -> None:
        # A report changes GPU cells (the cluster socket's deltas draw them); the blocks the heatmap
        # is grouped by, and the deployments' holders and TWU, change far less often: each is sent
        # when it differs from what this socket last got - at 1,000 nodes the blocks alone are ~300 KB.
        # The view itself is one build for every Overview socket whose event came before it started.
        assert self._fleet_push is not None  # it runs this
        fleet = await FLEET_VIEW.get(newer_than=self._fleet_push.poked_at)
        payload = present.fleet_payload(fleet)
        shape = fleet_shape(payload)
        if shape != self._fleet_shape:
            self._fleet_shape = shape
            await self.send_json({"type": "fleet", **payload})
        await self._send_deployments(await database_sync_to_async(present.deployments_state)(fleet), always=False)

    async def audit_entry(self, event: dict[str, Any]) -> None:
        if event["entry"].get("event_type") in OPERATOR_EVENTS:
            await self._send_deployments(await database_sync_to_async(present.deployments_state)())


def fleet_shape(payload: dict[str, Any]) -> Any:
    """The blocks as the Overview uses them: every field of each block but its free memory, the GPUs
    out and why, the error. A block's free memory moves with every report and the page does not draw
    it from here (static/js/cluster.js blockShape), so it is no reason to send the blocks again."""
    blocks = payload.get("blocks")
    kept = None if blocks is None else [{k: v for k, v in b.items() if k != "mem_free_bytes"} for b in blocks]
    return kept, payload.get("excluded"), payload.get("fleet_error")


def _switch(deployment: str, seq: int) -> dict[str, Any] | None:
    t = present.transitions_with_steps().filter(deployment__name=deployment, seq=seq).first()
    return present.transition_payload(t) if t is not None else None


class DeploymentConsumer(_GearboxLive):
    """One deployment's page: it joins its deployment's group only, which hears that deployment's
    gearbox events, the fleet deltas that touch its GPUs or plans and its operator verbs (the
    pushers route them: console.dashboard.groups) - never another deployment's."""

    page = "deployment"
    also = ()

    @property
    def name(self) -> str:
        return str(self.scope["url_route"]["kwargs"]["name"])

    @property
    def group(self) -> str:  # type: ignore[override]  # read-only: named after the deployment in the URL
        return deployment_group(self.name)

    async def on_accepted(self) -> None:
        await self.join_all()
        state = await database_sync_to_async(_deployment_state)(self.name)
        if state is None:
            await self.close(code=4404)
            return
        await self.send_json({"type": "snapshot", **state})

    async def send_all(self, messages: list[dict[str, Any]]) -> None:
        for msg in messages:
            await self.send_json(msg)

    async def gearbox_event(self, event: dict[str, Any]) -> None:
        ev = event["event"]
        if ev.get("deployment") != self.name:
            return
        seq = ev.get("seq") if ev.get("kind") == "transition" else None
        decision = ev.get("decision") if ev.get("kind") == "decision" else None
        await self._send_read_after(time.monotonic(), seq=seq, decision=decision)

    _push: Coalescer | None = None

    async def cluster_delta(self, event: dict[str, Any]) -> None:
        # Only deltas that touch this deployment come here (console.gearbox.live.fleet_delta_groups);
        # they are sent at most every FLEXPIPE_PUSH_MIN_INTERVAL_S.
        if self._push is None:
            self._push = self.coalesced(self._send_updates)
        self._push.poke()

    async def _send_updates(self) -> None:
        assert self._push is not None  # it runs this
        await self._send_read_after(self._push.poked_at)

    async def _send_read_after(self, event_at: float, *, seq: int | None = None, decision: int | None = None) -> None:
        """The messages an event makes, on a fleet view built after it came (shared with the other sockets)."""
        fleet = await FLEET_VIEW.get(newer_than=event_at)
        await self.send_all(await database_sync_to_async(_updates)(self.name, fleet, seq=seq, decision=decision))

    async def audit_entry(self, event: dict[str, Any]) -> None:
        entry = event["entry"]
        if entry.get("deployment") != self.name or entry.get("event_type") not in OPERATOR_EVENTS:
            return
        await self._send_read_after(time.monotonic(), decision=entry.get("decision_id"))


def _deployment_state(name: str) -> dict[str, Any] | None:
    dep = Deployment.objects.filter(name=name).first()
    return present.deployment_state(dep) if dep is not None else None


def _updates(name: str, fleet: present.FleetView, *, seq: int | None = None,
             decision: int | None = None) -> list[dict[str, Any]]:
    """The messages one event makes: the transition or decision it names, then the deployment -
    all read on one view of the fleet."""
    dep = Deployment.objects.filter(name=name).first()
    if dep is None:
        return []
    out: list[dict[str, Any]] = []
    if seq is not None:
        detail = present.transition_detail(name, seq, fleet)
        if detail is not None:
            out.append({"type": "transition", "transition": detail})
    if decision is not None:
        found = present.decision_detail(decision, fleet)
        if found is not None and found["deployment"] == name:
            out.append({"type": "decision", "decision": found})
    out.append({"type": "deployment", **present.deployment_update(dep, fleet)})
    return out
