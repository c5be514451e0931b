"""The agent API's own ASGI process: agent protocol v1 apart from the browsers (issue 19 d4).

    daphne -b 0.0.0.0 -p 8002 console.agent_asgi:application

(`make run`: supervisord's program `agents`, where the fleet reports; docker-compose: the `agents`
service, behind the edge's /agent/v1/.) It serves /agent/v1/... and, for this process itself,
/healthz and /metrics (console.agent_urls); every other path is a 404 here, and it takes no
websocket. The console's process (console.asgi) still serves the agent API as well, so an agent
pointed at the console's address keeps working; what this process buys is that the agents'
reports and long polls share no event loop and no interpreter lock with the browsers.

Why: at 1,000 agents the reports' tail was the Overview's fleet builds and pushes made in the same
process (py-spy, gc probes: issue 19's notes): each build holds the GIL for tens of milliseconds,
and every report that comes in meanwhile waits. Measured with bench.control_plane (1,000 agents,
the Overview open, this 2-core machine, the two layouts in alternate runs): report p99 356-369 ms
with the agents on the console's process (--one-process), 84-210 ms on their own (84-492 ms over
six runs of a noisy day); push p99 1.07-1.11 s -> 0.62-0.76 s.

The pushes need nothing from this process: a report hands its delta to console.fleet.pusher,
which sends it over the channel layer (Redis) to the console's sockets wherever they are, and a
long poll wakes on the Redis doorbell (console.fleet.doorbell) rung by whichever process issued
the command. The snapshot cache (console.gearbox.snapshot) keys on the node rows, so the
console's views see every report this process commits.
"""

from __future__ import annotations

import os

# This module is the agent API's process: the settings route only its URLs (settings.FLEXPIPE_PROCESS).
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
os.environ["FLEXPIPE_PROCESS"] = "agents"

from channels.routing import ProtocolTypeRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.exceptions import ImproperlyConfigured  # noqa: E402

from console.asgi import StopOnCancel, http_app, is_agent_api  # noqa: E402

if settings.FLEXPIPE_PROCESS != "agents":  # the settings were read before this module set it
    raise ImproperlyConfigured("console.agent_asgi must be the first thing the server imports (it sets "
                               f"FLEXPIPE_PROCESS=agents; the settings were already read with {settings.FLEXPIPE_PROCESS!r})")

application = ProtocolTypeRouter({"http": StopOnCancel(http_app, pooled=is_agent_api)})
