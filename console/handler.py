"""Django's ASGIHandler without a garbage cycle per request (issue 19).

Django 5.2's `ASGIHandler.handle` runs each request beside a `listen_for_disconnect` task that
raises RequestAborted when the server says the client is gone - and daphne says so after every
response. `handle` then reads that task's result and ignores the exception, but the exception's
traceback holds `handle`'s frame, whose `tasks` list holds the task, which holds the exception: a
reference cycle that only the cyclic garbage collector frees, and with it everything the frame
held - the request, the response, headers, the body file, contexts (about 110 objects a request).
Measured (`bench.control_plane --agents 1000`, the web process, DEBUG_SAVEALL over 20 s): 268,788
objects of cyclic garbage from 2,365 requests, and collections of 170,000 of them taking 330 ms
with the whole process stopped - those pauses were the report p99.

`Handler.listen_for_disconnect` ends its task on the disconnect instead of raising: `handle`
still sees the task done first and cancels a view that has not answered yet, as before, and the
request's objects go by reference counting when it ends. The console's processes (console.asgi:
the pages, the agent API's AgentApiHandler, and the gateway's process) all serve through it.
"""

from __future__ import annotations

from typing import Any

from django.core.handlers.asgi import ASGIHandler


class Handler(ASGIHandler):
    """An ASGIHandler whose disconnect listener returns instead of raising (module docstring)."""

    async def listen_for_disconnect(self, receive: Any) -> None:
        message = await receive()
        if message["type"] != "http.disconnect":  # Django's own check: nothing else may come after the body
            raise AssertionError(f"Invalid ASGI message after request body: {message['type']}")
