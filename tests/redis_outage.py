"""A private Redis that a test may stop and start again (never the machine's Redis on 6379), and the
console pointed at it: settings, the Celery app's pools and the channel layer.

Reaching into the Celery app's caches (_pool, amqp's producer pool, the backend) is what re-pointing
a live app takes; only tests do it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.conftest import TEST_NAMESPACE

REDIS_SERVER = shutil.which("redis-server")
needs_redis_server = pytest.mark.skipif(REDIS_SERVER is None, reason="needs Debian's redis-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRedis:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PrivateRedis:
        assert REDIS_SERVER is not None
        self.proc = subprocess.Popen([REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.folder)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                if redis.Redis.from_url(self.url, socket_timeout=0.5).ping():
                    return self
            except (redis.RedisError, OSError):
                pass
            assert time.monotonic() < deadline, "the private redis-server did not answer in 30 s"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)


def point_console_at(url: str, settings: Any) -> None:
    from channels.layers import channel_layers

    from console.celery import app

    settings.REDIS_URL = url
    settings.CELERY_BROKER_URL = settings.CELERY_RESULT_BACKEND = url
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                           "CONFIG": {"hosts": [url], "prefix": TEST_NAMESPACE}}}
    channel_layers.backends.clear()
    app.conf.update(broker_url=url, result_backend=url)
    app._pool = None  # not closed: kombu keeps one pool per URL and would hand the closed one back
    if "amqp" in app.__dict__:
        app.__dict__["amqp"]._producer_pool = None
    app._backend_cache = None
    app._local = threading.local()


@pytest.fixture
def private_redis(settings: Any, tmp_path: Path) -> Iterator[PrivateRedis]:
    from console import celery as console_celery
    from tests.conftest import TEST_REDIS_URL

    server = PrivateRedis(tmp_path).start()
    point_console_at(server.url, settings)
    console_celery._owed.clear()
    try:
        yield server
    finally:
        server.stop()
        console_celery._owed.clear()
        point_console_at(TEST_REDIS_URL, settings)
