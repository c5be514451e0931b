"""The gateway's own ASGI process: the data plane apart from the console (DESIGN.md, seed 000 §4.4).

    daphne -b 0.0.0.0 -p 8001 console.gateway.asgi:application

(`make run`: supervisord's program `gateway`; docker-compose: the `gateway` service, scaled on its
own.) It serves the OpenAI API (/v1/...) and, for this process itself, /healthz and /metrics
(console.gateway.urls); every other path is a 404 here - the agent API, the pages and the REST API
are the console's process (console.asgi, run with FLEXPIPE_PROCESS=console, where /v1 answers 421
naming FLEXPIPE_GATEWAY_URL). So a flood of streams shares no event loop, thread or database
connection with the agents' reports and the operators' pages.

What it shares with the console is the database and nothing else it needs at run time:

- Routing tables: each request reads its deployment's row (`routing`, `routing_version`:
  views._deployment) - a routing commit made by any process (a transition's SWITCH on a Celery
  worker, an operator's action in the console) is what the next request routes by, with no
  message to miss and no cache to expire; the router's pool of plans is cached per
  (deployment, routing_version) (routing._pool), so a new version is a new pool at once. While a
  switch has frozen the table, an admission re-reads the row every 50 ms until the new version
  (views._admit). A leader's data address is read per admission; engine reports are cached
  FLEXPIPE_ROUTER_REPORT_TTL_S (routing._reports).
- Its database calls run on console.db_pool's few shared threads (FLEXPIPE_POLL_DB_THREADS): an
  open stream holds no thread and no database connection while tokens flow, so a hundred
  streams cost the database a handful of connections, not a hundred.
- Process-local state (the router's prefix index and load book, the metrics) is per gateway
  process, as with several console processes before (docs/gateway.md).
"""

from __future__ import annotations

import os

# This module is the gateway's process: the settings route only its URLs (settings.FLEXPIPE_PROCESS).
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
os.environ["FLEXPIPE_PROCESS"] = "gateway"

from channels.routing import ProtocolTypeRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.exceptions import ImproperlyConfigured  # noqa: E402

from console.asgi import StopOnCancel, django_asgi_app  # noqa: E402

if settings.FLEXPIPE_PROCESS != "gateway":  # the settings were read before this module set it
    raise ImproperlyConfigured("console.gateway.asgi must be the first thing the server imports (it sets "
                               f"FLEXPIPE_PROCESS=gateway; the settings were already read with {settings.FLEXPIPE_PROCESS!r})")


def _every_path(path: str) -> bool:
    return True


application = ProtocolTypeRouter({"http": StopOnCancel(django_asgi_app, pooled=_every_path)})
