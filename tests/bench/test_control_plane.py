"""bench.control_plane's figures that are pure arithmetic (the run itself is the benchmark's, not a test's)."""

from __future__ import annotations

import asyncio

from bench.control_plane import _cancel_all, _max_by_second


def test_the_slowest_report_of_each_second_shows_a_stall_as_its_seconds() -> None:
    start = 100.0
    sent = [100.1, 100.9, 101.5, 102.2, 102.3, 104.99]
    ms = [5.0, 7.0, 250.0, 300.0, 6.0, 9.0]
    assert _max_by_second(ms, sent, start, step_s=5) == [7.0, 250.0, 300.0, 0.0, 9.0]
    # a report sent just before the step or after its end counts in the first or the last second
    assert _max_by_second([1.0, 2.0], [99.9, 106.0], start, step_s=5) == [1.0, 0.0, 0.0, 0.0, 2.0]


def test_cancelling_goes_on_until_a_task_that_swallowed_it_ends() -> None:
    async def swallows_one_cancel(ended: list[str]) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            pass  # as wait_for did when its request completed as the cancel came (bpo-42130)
        try:
            await asyncio.sleep(60)
        finally:
            ended.append("ended")

    async def run() -> list[str]:
        ended: list[str] = []
        task = asyncio.ensure_future(swallows_one_cancel(ended))
        await asyncio.sleep(0)
        await _cancel_all([task])
        assert task.cancelled()
        return ended

    assert asyncio.run(run()) == ["ended"]
