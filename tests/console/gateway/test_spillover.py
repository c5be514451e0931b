"""The spillover timeout in the gateway (scheduler/router/spillover.py has the rule; routing.py
the gateway's side): with FLEXPIPE_ROUTER_POLICY flexpipe+budget, a request sent away from its
saturated first choice is watched until its first token; past the timeout it is counted once - a
counter, and a Redis stamp that /metrics exports as flexpipe_spillover_timeouts_recent - and
re-routed back to its first choice once that has room again."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from console.fleet.models import Node
from console.gateway import learned, metrics, routing, views
from console.gateway.routing import Candidate
from console.metrics import REGISTRY
from console.metrics.views import register_collectors
from scheduler.router.spillover import Spilled
from tests.console.gateway.test_routing import gpu_node, order, route, tp4
from tests.console.gateway.world import make_deployment

pytestmark = pytest.mark.django_db


def joined(fn: Any, *args: Any) -> None:
    t = threading.Thread(target=fn, args=args)
    t.start()
    t.join()


@pytest.fixture(autouse=True)
def _budget(settings: Any, monkeypatch: pytest.MonkeyPatch, redis_client: Any) -> Iterator[None]:
    settings.FLEXPIPE_ROUTER_SEED = 11
    settings.FLEXPIPE_ROUTER_SAMPLE_S = 1e9
    settings.FLEXPIPE_ROUTER_REPORT_TTL_S = 0.0
    settings.FLEXPIPE_ROUTER_FLEET_TTL_S = 0.0
    settings.FLEXPIPE_ROUTER_POLICY = "flexpipe+budget"
    settings.FLEXPIPE_ROUTER = {"spill": {"spill_timeout_s": 0.0}}  # due at once: no waiting in a test
    monkeypatch.setattr(learned, "soon", joined)  # the Redis stamp written before the next step
    routing.reset()
    redis_client.delete(routing.SPILL_PREFIX + "chat")
    yield
    routing.reset()
    redis_client.delete(routing.SPILL_PREFIX + "chat")


def report(node: str, plan_id: str, kv_usage: float, waiting: int = 0) -> None:
    Node.objects.filter(node_id=node).update(engines=[{"plan_id": plan_id, "running": 1, "waiting": waiting,
                                                        "tokens_per_s": 1.0, "kv_usage": kv_usage}])


PROMPT = 8000


def pool() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Three H100 plans; `home` is the first choice - it served the prompt before (its prefix is
    cached there) - with 95% of its KV used."""
    for n in ("h1", "h2", "h3"):
        gpu_node(n, "H100-SXM")
    routes = [route(tp4(n), n) for n in ("h1", "h2", "h3")]
    make_deployment("chat", routes)
    warm = order(routes, PROMPT)
    routing.admitted(warm, next(c for c in warm.candidates if c.plan_id == routes[0]["plan_id"]), "warm")
    routing.done("warm")
    for i, n in enumerate(("h1", "h2", "h3")):
        report(n, routes[i]["plan_id"], 0.95 if i == 0 else 0.0, waiting=0 if i == 0 else 4)
    return routes[0], routes


def spilled_one(routes: list[dict[str, Any]]) -> routing.Routed:
    for _ in range(20):  # a spill target takes half of the spilled requests (by each one's draw)
        routed = order(routes, PROMPT)
        if routed.decision.spilled_from is not None:
            return routed
    raise AssertionError("no request spilled")


def timeouts() -> float:
    return metrics.SPILL_TIMEOUTS.labels("chat")._value.get()


def test_a_spilled_request_whose_first_token_comes_in_time_is_not_counted() -> None:
    home, routes = pool()
    routed = spilled_one(routes)
    assert routed.decision.explain()["spilled_from"] == home["plan_id"] != routed.candidates[0].plan_id
    before = timeouts()
    spilled = routing.admitted(routed, routed.candidates[0], "req-1")
    assert spilled is not None and spilled.home == home["plan_id"]
    routing.first_token("req-1")
    assert routing.spill_timeout(spilled, order(routes, PROMPT)) is None and timeouts() == before
    routing.done("req-1")


def test_one_past_the_timeout_is_counted_once_exported_and_goes_back_to_its_first_choice_once_it_has_room(
        redis_client: Any) -> None:
    home, routes = pool()
    routed = spilled_one(routes)
    at = routed.candidates[0].plan_id
    before = timeouts()
    spilled = routing.admitted(routed, routed.candidates[0], "req-2")
    assert spilled is not None
    report("h1", home["plan_id"], 0.2)  # the first choice freed up: it takes its own traffic again
    target = routing.spill_timeout(spilled, order(routes, PROMPT))
    assert target is not None and target.candidates[0].plan_id == home["plan_id"]
    assert at not in [c.plan_id for c in target.candidates]  # not back where it timed out
    assert timeouts() == before + 1
    assert routing.spill_timeout(spilled, order(routes, PROMPT)) is None and timeouts() == before + 1  # once
    # the re-routed request, even if its new decision spills again, is not watched again
    again = routing.admitted(target, target.candidates[0], "req-2-s1", key="req-2")
    assert again is None
    routing.done("req-2")
    routing.done("req-2-s1")

    assert routing.spill_timeouts_recent(["chat"], 300.0) == {("chat", at): 1}
    register_collectors()
    samples = {(s.labels["deployment"], s.labels["plan_id"]): s.value for f in REGISTRY.collect()
               if f.name == "flexpipe_spillover_timeouts_recent" for s in f.samples}
    assert samples == {("chat", at): 1.0}


def test_with_nothing_better_it_keeps_its_place() -> None:
    home, routes = pool()
    routed = spilled_one(routes)
    spilled = routing.admitted(routed, routed.candidates[0], "req-3")
    assert spilled is not None
    for i, n in enumerate(("h2", "h3")):  # every other plan in the band that takes no spills
        report(n, routes[i + 1]["plan_id"], 0.8, waiting=4)
    assert routing.spill_timeout(spilled, order(routes, PROMPT)) is None  # counted, stays where it waits
    routing.done("req-3")


def test_an_unknown_router_policy_is_named_and_budget_is_known(settings: Any) -> None:
    assert learned.policy_name() == "flexpipe+budget"
    settings.FLEXPIPE_ROUTER_POLICY = "spill"
    with pytest.raises(ValueError, match="FLEXPIPE_ROUTER_POLICY: unknown 'spill'.*flexpipe\\+budget"):
        learned.policy_name()


# -- the view's side: the wait for the first token, the stream closed on a re-route ------------------


class Stream:
    """A data-plane stream whose first token comes once `go` is set; `closed` once it was closed."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.closed = False

    async def tokens(self) -> AsyncIterator[int]:
        try:
            await self.go.wait()
            yield 7
        finally:
            self.closed = True


def spilled_admission() -> tuple[Any, Any, Spilled]:
    dep = views._Deployment("chat", "m", 1, [])
    spill = Spilled("job-1", "home", "away", 0.0, 0.0)  # its deadline passed
    adm = views.Admitted(dep, Candidate("away", 1.0, "n2", {}), None, "job-1", spill)  # type: ignore[arg-type]
    job = SimpleNamespace(req=None, dep=dep, prompt_ids=[1, 2], max_tokens=4, id="job-1")
    return job, adm, spill


def test_past_its_deadline_the_view_closes_the_stream_and_opens_it_where_the_router_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    job, adm, spill = spilled_admission()
    stream = Stream()
    home = Candidate("home", 1.0, "n1", {})
    opened: list[tuple[str, str | None]] = []

    async def fresh(*_: Any) -> str:
        return "fresh"

    async def admit(req: Any, dep: Any, ids: Any, n: int, seq_id: str, *, routed: Any, key: str | None) -> Any:
        opened.append((seq_id, key))
        return views.Admitted(dep, home, "new-resp", seq_id)  # type: ignore[arg-type]

    monkeypatch.setattr(views, "_route", fresh)
    monkeypatch.setattr(views.routing, "spill_timeout", lambda s, f: "target" if s is spill and f == "fresh" else None)
    monkeypatch.setattr(views, "_admit", admit)
    views.OUTSTANDING["away"] += 1

    async def wait() -> tuple[tuple[int | None, bool], bool]:
        got = await views._spill_wait(job, adm, stream.tokens())
        return got, stream.closed

    (head, moved), closed = asyncio.run(wait())
    assert (head, moved) == (None, True) and closed  # the old stream is gone: dropped from that engine
    assert adm.route is home and adm.resp == "new-resp" and adm.spill is None
    assert opened == [(adm.seq_id, "job-1")] and adm.seq_id.startswith("job-1-s")
    assert views.OUTSTANDING.pop(home.plan_id) == 1 and "away" not in views.OUTSTANDING


def test_when_it_keeps_its_place_the_view_goes_on_waiting_for_the_same_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    job, adm, spill = spilled_admission()
    stream = Stream()

    async def fresh(*_: Any) -> str:
        return "fresh"

    def stays(s: Spilled, f: Any) -> None:
        stream.go.set()  # its first token comes after the deadline, while it kept its place
        return None

    monkeypatch.setattr(views, "_route", fresh)
    monkeypatch.setattr(views.routing, "spill_timeout", stays)

    async def wait() -> tuple[tuple[int | None, bool], bool]:
        tokens = stream.tokens()
        got = await views._spill_wait(job, adm, tokens)
        return got, stream.closed  # (asyncio.run closes what is left open when it ends)

    (head, moved), closed = asyncio.run(wait())
    assert (head, moved) == (7, False) and not closed and adm.route.plan_id == "away"
