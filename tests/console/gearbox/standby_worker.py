"""A Celery worker process that loads everything first, then waits for a go before it consumes.

The crash tests start the next worker while the current one runs, so a restart after a SIGKILL
costs a Redis round trip instead of an interpreter and Django start. Once told to go it is a
plain `celery worker -P solo` (console.celery.app.worker_main) on the given queue.

    python standby_worker.py GO_KEY QUEUE NAME
"""

from __future__ import annotations

import os
import sys

import django
import redis

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
django.setup()

from console.celery import app  # noqa: E402 - after django.setup()
from console.fleet import tasks as fleet_tasks  # noqa: E402,F401
from console.gearbox import tasks  # noqa: E402,F401 - import every task module now, not after the go


def main() -> None:
    go_key, queue, name = sys.argv[1:4]
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    while client.blpop([go_key], timeout=1) is None:  # short waits: a socket timeout must not end it
        pass
    client.close()
    app.worker_main(["worker", "-P", "solo", "-Q", queue, "--without-gossip", "--without-mingle",
                     "--without-heartbeat", "-l", "warning", "-n", name])


if __name__ == "__main__":
    main()
