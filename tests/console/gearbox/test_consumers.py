"""The gearbox pages' websockets: who may connect, the first state, and what each committed change pushes.

Changes are made the way they happen (the REST API as an operator, the gearbox tick, an agent's
report); each push arrives because its transaction committed. Every communicator disconnects.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from console.asgi import application
from console.dashboard.groups import deployment_group
from console.gearbox import consumers, live, ticks
from console.gearbox.actions import do_set_mode
from tests.conftest import TEST_REDIS_URL
from tests.console.gearbox.harness import enroll_fleet, gear, make_deployment, uuid
from tests.console.gearbox.ops import MOVED, World, engine_report, running_deployment
from tests.console.people import Person, make_person

pytestmark = pytest.mark.django_db(transaction=True)


def communicator(path: str, user: Any | None) -> WebsocketCommunicator:
    comm = WebsocketCommunicator(application, path, headers=[(b"origin", b"http://testserver"),
                                                             (b"host", b"testserver")])
    if user is not None:
        comm.scope["user"] = user
    return comm


async def until(comm: WebsocketCommunicator, wanted: Callable[[dict[str, Any]], bool],
                timeout_s: float = 5.0) -> dict[str, Any]:
    """The first message that satisfies `wanted` (others, pushed by the same change, are skipped)."""
    while True:
        msg = await comm.receive_json_from(timeout=timeout_s)
        if wanted(msg):
            return msg  # type: ignore[no-any-return]


def api_post(person: Person, path: str, body: dict[str, Any]) -> Any:
    return person.api().post(path, json.dumps(body), content_type="application/json")


@pytest.mark.parametrize("path", ["/ws/gearbox/", "/ws/deployments/chat/"])
async def test_anonymous_and_roleless_users_are_turned_away(path: str) -> None:
    otto = await database_sync_to_async(make_person)("otto", None)
    for user, expected in ((None, 4401), (otto.user, 4403)):
        comm = communicator(path, user)
        try:
            connected, code = await comm.connect()
            assert not connected and code == expected
        finally:
            await comm.disconnect()


async def test_an_unknown_deployment_closes_with_4404() -> None:
    vera = await database_sync_to_async(make_person)("vera", "viewer")
    comm = communicator("/ws/deployments/nope/", vera.user)
    try:
        connected, _ = await comm.connect()
        assert connected
        assert (await comm.receive_output(timeout=5))["code"] == 4404
    finally:
        await comm.disconnect()


async def test_the_gearbox_socket_sends_deployments_blocks_and_switches_then_follows_them() -> None:
    world: World = await database_sync_to_async(running_deployment)()
    vera = await database_sync_to_async(make_person)("vera", "viewer")
    oscar = await database_sync_to_async(make_person)("oscar", "operator")
    comm = communicator("/ws/gearbox/", vera.user)
    connected, _ = await comm.connect()
    assert connected
    try:
        snap = await comm.receive_json_from(timeout=5)
        assert snap["type"] == "snapshot"
        assert [d["name"] for d in snap["deployments"]] == ["chat"]
        assert snap["deployments"][0]["current_gear"]["gear_id"] == MOVED.gear_id
        assert {b["id"] for b in snap["blocks"]} == {"a1/nvlnvl0", "b1/nvlnvl0"} and snap["excluded"] == {}
        assert [h["deployment"] for h in snap["holders"]["GPU-b1-4"]] == ["chat"]
        assert [(t["seq"], t["phase"]) for t in snap["switches"]] == [(2, "done"), (1, "done")]

        # an operator pins through the API: the audit entry's commit wakes the page
        assert (await database_sync_to_async(api_post)(oscar, "/api/v1/deployments/chat/pin", {})).status_code == 200
        msg = await until(comm, lambda m: m["type"] == "deployments")
        assert msg["deployments"][0]["mode"] == "pinned"

        # another tenant takes a GPU of b1: the report moves it out of its block, the deployment degrades
        world.reporter.gone = {"GPU-b1-5"}
        await database_sync_to_async(world.reporter.report)("b1")
        fleet = await until(comm, lambda m: m["type"] == "fleet")
        assert fleet["excluded"] == {"GPU-b1-5": "not schedulable"}
        deps = await until(comm, lambda m: m["type"] == "deployments")
        assert deps["deployments"][0]["health"]["state"] == "degraded"
        assert deps["deployments"][0]["health"]["reasons"][0] == "GPU b1/5 is out (not schedulable)"  # by node/index

        # the emergency: a tick starts the downshift, and the switch arrives as it is created
        resp = await database_sync_to_async(api_post)(oscar, "/api/v1/deployments/chat/emergency",
                                                      {"reason": "b1 preempted"})
        assert resp.status_code == 202
        await database_sync_to_async(ticks.tick)(trigger="emergency", deployment="chat")
        switch = await until(comm, lambda m: m["type"] == "switch")
        assert switch["transition"]["seq"] == 3 and switch["transition"]["kind"] == "emergency"
        assert switch["transition"]["phases"][0]["phase"] == "prepare"
    finally:
        await comm.disconnect()


async def test_the_deployment_socket_follows_its_deployment_and_ignores_others() -> None:
    world: World = await database_sync_to_async(running_deployment)()
    other = await database_sync_to_async(enroll_fleet)({"c1": "C"})  # a node chat has no gear on
    vera = await database_sync_to_async(make_person)("vera", "viewer")
    oscar = await database_sync_to_async(make_person)("oscar", "operator")
    comm = communicator("/ws/deployments/chat/", vera.user)
    connected, _ = await comm.connect()
    assert connected
    try:
        snap = await comm.receive_json_from(timeout=5)
        assert snap["type"] == "snapshot" and snap["deployment"]["name"] == "chat"
        assert [t["seq"] for t in snap["transitions"]] == [2, 1] and len(snap["decisions"]) == 2
        assert snap["gears"]["current"]["gear_id"] == MOVED.gear_id and snap["gears"]["target"] is None
        assert {g["node"] for g in snap["gpus"]} == {"a1", "b1"} and snap["deployment"]["serving"] is None

        # the engine of the routed plan reports: the page gets the serving figures
        plan_id = MOVED.plans[0].plan_id
        await database_sync_to_async(world.report_engines)("b1", engine_report(plan_id, tokens_per_s=1234.5))
        msg = await until(comm, lambda m: m["type"] == "deployment")
        assert msg["deployment"]["serving"]["tokens_per_s"] == 1234.5
        assert msg["deployment"]["serving"]["ttft_p95_ms"] == 180.0

        # a report of a node it has no gear on pushes nothing here
        await database_sync_to_async(other.report)("c1")
        assert await comm.receive_nothing(timeout=0.5)

        # the emergency request (audited) and the transition it starts (pushed step by step)
        resp = await database_sync_to_async(api_post)(oscar, "/api/v1/deployments/chat/emergency",
                                                      {"reason": "TTFT alarm"})
        assert resp.status_code == 202
        msg = await until(comm, lambda m: m["type"] == "deployment")
        assert msg["deployment"]["emergency"]["reason"] == "TTFT alarm"
        await database_sync_to_async(ticks.tick)(trigger="emergency", deployment="chat")
        decision = await until(comm, lambda m: m["type"] == "decision")
        assert decision["decision"]["trigger"] == "emergency" and decision["decision"]["candidates"]
        started = await until(comm, lambda m: m["type"] == "transition")
        t = started["transition"]
        assert (t["seq"], t["kind"], t["phase"], t["active"]) == (3, "emergency", "prepare", True)
        assert t["to_gear_detail"]["plans"][0]["stages"][0]["gpus"][0]["node"] == "a1" and "steps" in t
        msg = await until(comm, lambda m: m["type"] == "deployment")
        assert msg["gears"]["target"]["gear_id"] == t["to_gear"]["gear_id"]
        assert msg["deployment"]["active_transition"]["seq"] == 3
    finally:
        await comm.disconnect()


def _members(group: str) -> int:
    """Sockets in a channel-layer group, as Redis holds it (channels_redis: "<prefix>:group:<name>")."""
    import redis
    from channels.layers import get_channel_layer

    return int(redis.Redis.from_url(TEST_REDIS_URL).zcard(f"{get_channel_layer().prefix}:group:{group}"))


async def test_a_deployment_page_hears_nothing_of_another_deployments_changes() -> None:
    """Per-page subscriptions (issue 19): a deployment's socket joins its deployment's group only, and
    the pushers route a change there only when it concerns that deployment."""
    world: World = await database_sync_to_async(running_deployment)()
    fleet_c = await database_sync_to_async(enroll_fleet)({"c1": "C"})
    await database_sync_to_async(make_deployment)("other", baseline=gear("c1", [0, 1]))
    vera = await database_sync_to_async(make_person)("vera", "viewer")
    chat, other = communicator("/ws/deployments/chat/", vera.user), communicator("/ws/deployments/other/", vera.user)
    try:
        for comm, name in ((chat, "chat"), (other, "other")):
            assert (await comm.connect())[0]
            snap = await comm.receive_json_from(timeout=5)
            assert snap["type"] == "snapshot" and snap["deployment"]["name"] == name
        # each socket is in its deployment's group, none in the fleet's
        assert [await database_sync_to_async(_members)(g) for g in
                (deployment_group("chat"), deployment_group("other"), "cluster", "gearbox", "audit")] == [1, 1, 0, 0, 0]

        # other's changes: a report of its GPUs, an operator verb, a routing commit - other hears each
        fleet_c.extra["GPU-c1-0"] = 4 * 2**30  # its first GPU's memory moves
        await database_sync_to_async(fleet_c.report)("c1")
        assert (await other.receive_json_from(timeout=10))["deployment"]["name"] == "other"
        await database_sync_to_async(do_set_mode)("other", "advisory", actor="system:test")
        msg = await until(other, lambda m: m["type"] == "deployment" and m["deployment"]["mode"] == "advisory", 10)
        await database_sync_to_async(live.push_routing)("other")
        assert (await other.receive_json_from(timeout=10))["type"] == "deployment"

        # chat's own change comes next on chat's socket: nothing of other's came before it
        plan_id = MOVED.plans[0].plan_id
        await database_sync_to_async(world.report_engines)("b1", engine_report(plan_id, tokens_per_s=777.0))
        msg = await chat.receive_json_from(timeout=10)
        assert msg["type"] == "deployment" and msg["deployment"]["name"] == "chat"
        assert msg["deployment"]["serving"]["tokens_per_s"] == 777.0
    finally:
        for comm in (chat, other):
            await comm.disconnect()


async def test_a_report_that_changes_only_gpu_memory_sends_no_blocks_again() -> None:
    # the cluster socket's deltas draw the cells; the gearbox socket sends the blocks again only when
    # what the page draws of them changes (console.gearbox.consumers.fleet_shape), and the
    # deployments only when they differ from what it last sent
    world: World = await database_sync_to_async(running_deployment)()
    vera = await database_sync_to_async(make_person)("vera", "viewer")
    comm = communicator("/ws/gearbox/", vera.user)
    connected, _ = await comm.connect()
    assert connected
    try:
        assert (await comm.receive_json_from(timeout=5))["type"] == "snapshot"
        for k in (1, 2):  # a GPU nothing runs on fills a little: memory moves, the blocks do not
            world.reporter.extra[uuid("b1", 6)] = k * 2**30
            await database_sync_to_async(world.reporter.report)("b1")
        got = []
        while not await comm.receive_nothing(timeout=1.5):
            got.append((await comm.receive_json_from())["type"])
        assert "fleet" not in got, got
        world.reporter.gone = {"GPU-b1-5"}  # now a GPU leaves its block: the blocks come again
        await database_sync_to_async(world.reporter.report)("b1")
        fleet = await until(comm, lambda m: m["type"] == "fleet")
        assert fleet["excluded"] == {"GPU-b1-5": "not schedulable"}
    finally:
        await comm.disconnect()


async def test_two_overview_sockets_share_one_fleet_view_per_report() -> None:
    # every open Overview used to build the whole fleet's view for itself (issue 19: per report per
    # browser); one report is now one build for all of them, and each gets the blocks it changed
    world: World = await database_sync_to_async(running_deployment)()
    vera = await database_sync_to_async(make_person)("vera", "viewer")
    comms = [communicator("/ws/gearbox/", vera.user) for _ in range(2)]
    try:
        for comm in comms:
            assert (await comm.connect())[0]
            assert (await comm.receive_json_from(timeout=5))["type"] == "snapshot"
        before = consumers.FLEET_VIEW.builds
        world.reporter.gone = {"GPU-b1-5"}  # a GPU leaves its block
        await database_sync_to_async(world.reporter.report)("b1")
        for comm in comms:
            fleet = await until(comm, lambda m: m["type"] == "fleet")
            assert fleet["excluded"] == {"GPU-b1-5": "not schedulable"}
        assert consumers.FLEET_VIEW.builds - before == 1
    finally:
        for comm in comms:
            await comm.disconnect()


async def test_a_deployment_page_and_an_overview_share_one_fleet_view_per_report(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a deployment page read the whole fleet's view for itself on every delta that touched it; it
    # now takes the same build as the Overview sockets of its process. The delta reaches the two
    # sockets through two groups, a Redis round trip apart: a wide gather keeps a loaded machine's
    # delay between them inside it
    monkeypatch.setattr(consumers.FLEET_VIEW, "gather_s", 0.5)
    world: World = await database_sync_to_async(running_deployment)()
    vera = await database_sync_to_async(make_person)("vera", "viewer")
    overview, page = communicator("/ws/gearbox/", vera.user), communicator("/ws/deployments/chat/", vera.user)
    try:
        for comm in (overview, page):
            assert (await comm.connect())[0]
            assert (await comm.receive_json_from(timeout=5))["type"] == "snapshot"
        before = consumers.FLEET_VIEW.builds
        world.reporter.gone = {"GPU-b1-5"}  # a GPU of chat's gear leaves its block
        await database_sync_to_async(world.reporter.report)("b1")
        fleet = await until(overview, lambda m: m["type"] == "fleet")
        assert fleet["excluded"] == {"GPU-b1-5": "not schedulable"}
        update = await until(page, lambda m: m["type"] == "deployment")
        assert update["deployment"]["name"] == "chat"
        assert consumers.FLEET_VIEW.builds - before == 1
    finally:
        for comm in (overview, page):
            await comm.disconnect()
