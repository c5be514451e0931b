"""WhiteNoise, async-capable: the middleware chain stays async so an async view runs on the loop.

WhiteNoise 6.12's middleware is sync-only. One sync middleware makes Django run the whole chain
above it in the request's own thread, which then blocks in async_to_sync for as long as the view
runs: every pending agent long poll held a thread (issue 19). Here a static path is looked up as
WhiteNoise does (a dict lookup; on disk only with autorefresh, in DEBUG, off the loop) and every
other request goes on down the chain in the caller's mode.
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from whitenoise.middleware import WhiteNoiseMiddleware


class WhiteNoise(WhiteNoiseMiddleware):  # type: ignore[misc]
    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(get_response, *args, **kwargs)
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: Any) -> Any:
        if self.is_async:
            return self._acall(request)
        return super().__call__(request)

    async def _acall(self, request: Any) -> Any:
        if self.autorefresh:
            static_file = await sync_to_async(self.find_file, thread_sensitive=False)(request.path_info)
        else:
            static_file = self.files.get(request.path_info)
        if static_file is not None:
            return self.serve(static_file, request)
        return await self.get_response(request)
