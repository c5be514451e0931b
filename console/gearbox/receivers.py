"""The gearbox listens to the fleet: acks drive transitions, topology events trigger a tick.

Both signals are sent on commit (console.fleet.actions), so what the tasks read is stored. And the
fleet's live deltas and the audit's entries also go to the pages of the deployments they concern
(console.dashboard.groups; console.gearbox.live names the groups).
"""

from __future__ import annotations

from typing import Any

from django.dispatch import receiver

from console.dashboard import groups
from console.fleet.signals import command_acked, topology_changed
from console.gearbox import live, lost_release

groups.add_router("cluster.delta", live.fleet_delta_groups)
groups.add_router("audit.entry", live.audit_entry_groups)


@receiver(command_acked)
def on_command_acked(sender: Any, command: Any, **kwargs: Any) -> None:
    from console.gearbox import tasks

    if command.transition_seq and command.deployment:
        tasks.enqueue(tasks.advance, deployment=command.deployment, seq=command.transition_seq)
    elif command.key.startswith("gearbox.delete/") and command.deployment:
        tasks.enqueue(tasks.tick, trigger="periodic", deployment=command.deployment)  # it may be deleted now
    elif command.key.startswith(f"{lost_release.KEY}/") and command.deployment:
        # a lost plan's stage is released (or its agent gave up): the tick frees what it held
        tasks.enqueue(tasks.tick, trigger="periodic", deployment=command.deployment)


@receiver(topology_changed)
def on_topology_changed(sender: Any, node_ids: list[str] | None = None, **kwargs: Any) -> None:
    from console.gearbox import coalesce, tasks

    coalesce.request_tick(tasks.tick, trigger="topology")  # one pending tick for a burst of events
