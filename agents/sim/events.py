"""The simulator's events: what its heap holds, and in which order events at one instant run.

An event is (time, kind, handler, argument): when its time comes the fleet calls
`handler(time, argument)` and pushes the events that returns (agents/sim/fleet.py). Ties at one
instant run by kind, then in the order they were pushed (the fleet adds a sequence number).
"""

from __future__ import annotations

from collections.abc import Callable

# Event kinds: ties at one instant run in this order (cluster changes before the work they hit).
KIND_CLUSTER = 0
KIND_READY = 1
KIND_LAND = 2
KIND_ARRIVAL = 3
KIND_BOUNDARY = 4
KIND_TIMER = 5

Event = tuple[float, int, Callable[[float, object], "list[Event] | None"], object]
