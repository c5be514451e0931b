"""HTTP endpoints of agent protocol v1 (agents/protocol/ has the messages and the rules).

Agent tokens are accepted here and nowhere else; user sessions are not accepted here. Every
refusal is JSON: {"errors": {field path: reason}} with a 4xx status, and stores nothing.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from agents import schema
from agents.protocol import Command, RegisterResponse, SchemaError, parse_ack, parse_register, parse_report
from console.celery import flush_owed
from console.fleet import actions, doorbell
from console.fleet.models import AgentCommand, Node

MAX_WAIT_S = 30.0
IDLE_JITTER = 0.2  # an idle poll answers between 80% and 100% of its wait (_idle_answer_s)


def _error(status: int, errors: dict[str, str]) -> JsonResponse:
    return JsonResponse({"errors": errors}, status=status)


def _bearer(request: HttpRequest) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


def _json_body(request: HttpRequest) -> Any:
    try:
        body = schema.loads(request.body)
    except SchemaError as exc:
        raise actions.Rejected(400, exc.errors) from exc
    # PostgreSQL text and jsonb cannot hold U+0000: refuse it here rather than fail with a 500 on save.
    # JSON can only carry it escaped (\u0000; a raw NUL byte is not JSON): a body without that text
    # has none, and the walk over every value is spared (a report: hundreds of strings).
    if (b"\\u0000" in request.body or b"\x00" in request.body) and _has_nul(body):
        raise actions.Rejected(400, {"(body)": "must not contain NUL (\\u0000) characters"})
    return body


def _agent_token(request: HttpRequest) -> str:
    token = _bearer(request)
    if not token:
        raise actions.Rejected(401, {"Authorization": "missing; send 'Authorization: Bearer <agent token>'"})
    return token


def _authenticated_node(request: HttpRequest) -> Node:
    node = actions.node_for_token(_agent_token(request))
    if node is None:
        raise actions.unknown_token()
    return node


@csrf_exempt
@require_POST
def register(request: HttpRequest) -> JsonResponse:
    try:
        req = parse_register(_json_body(request))
        token = _bearer(request)
        if not token:
            raise actions.Rejected(401, {"Authorization": "missing; send the join token or the agent's own token"})
        reg = actions.do_register_node(req, token=token, now=timezone.now())
    except SchemaError as exc:
        return _error(400, exc.errors)
    except actions.Rejected as exc:
        return _error(exc.status, exc.errors)
    resp = RegisterResponse(
        node_id=reg.node.node_id,
        epoch=reg.node.epoch,
        report_interval_s=settings.FLEXPIPE_REPORT_INTERVAL_S,
        agent_token=reg.agent_token,
    )
    return JsonResponse(resp.to_dict(), status=201 if reg.agent_token else 200)


@csrf_exempt
@require_POST
def report(request: HttpRequest) -> JsonResponse:
    try:
        token = _agent_token(request)
        agent = actions.agent_for_token(token)  # remembered: the report's own claim checks the token
        if agent is None:
            raise actions.unknown_token()
        rep = parse_report(_json_body(request))
        try:
            seq = actions.do_ingest_report(agent, rep, now=timezone.now())
        except actions.Rejected as exc:
            # The token this process remembered is not that node's any more: the database says whose it is
            if exc.status != 401 or (agent := actions.agent_for_token(token, remembered=False)) is None:
                raise
            seq = actions.do_ingest_report(agent, rep, now=timezone.now())
    except SchemaError as exc:
        return _error(400, exc.errors)
    except actions.Rejected as exc:
        return _error(exc.status, exc.errors)
    # Whatever this process could not send during a broker outage (a topology tick, an advance) goes
    # now, at the first report after the broker is back - not at the next beat.
    flush_owed()
    return JsonResponse({"accepted": seq})


def _command_payload(cmd: AgentCommand) -> dict[str, Any]:
    return Command(
        id=cmd.id,
        kind=cmd.kind,
        payload=cmd.payload,
        deployment=cmd.deployment or None,
        transition_seq=cmd.transition_seq,
        step=cmd.step or None,
    ).to_dict()


def _hand_out(cmds: list[AgentCommand]) -> list[dict[str, Any]]:
    if cmds:
        actions.mark_delivered(cmds, now=timezone.now())
    return [_command_payload(c) for c in cmds]


def _deliver(node: Node, after: int) -> list[dict[str, Any]]:
    return _hand_out(actions.open_commands(node, after))


def _idle_answer_s(wait_s: float) -> float:
    """How long an idle poll waits before it answers with nothing: a random point in the last
    fifth of `wait`, as kube-apiserver spreads its watches' timeouts. A fleet enrolled together
    (or reconnected together after a console restart) polled again together every `wait`: 200
    polls answered in one second queued their queries ahead of every report, and reports waited
    2-11 s behind them (issue 19, bench.control_plane). The jitter spreads the renewals over time."""
    return wait_s * random.uniform(1.0 - IDLE_JITTER, 1.0)  # noqa: S311 - spreading load, not a secret


def _poll_start(request: HttpRequest, after: int) -> tuple[Node, list[dict[str, Any]]]:
    """The poll's first database call: the agent's node and its open commands, one query in one
    borrowed thread (issue 19: a thousand agents' polls start here)."""
    node, cmds = actions.node_and_open_commands(_agent_token(request), after)
    if node is None:
        raise actions.unknown_token()
    return node, _hand_out(cmds)


def _poll_arguments(request: HttpRequest) -> tuple[int, float]:
    errors: dict[str, str] = {}
    try:
        after = int(request.GET.get("after", "0"))
        if after < 0:
            raise ValueError
    except ValueError:
        errors["after"] = "must be an integer >= 0 (the last command id the agent saw)"
        after = 0
    try:
        wait_s = float(request.GET.get("wait", "0"))
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise ValueError
    except ValueError:
        errors["wait"] = f"must be a number of seconds between 0 and {MAX_WAIT_S:g}"
        wait_s = 0.0
    if errors:
        raise actions.Rejected(400, errors)
    return after, wait_s


@csrf_exempt
@require_GET
async def commands(request: HttpRequest) -> JsonResponse:
    """Long poll: answer at once when commands are open, else wait for the doorbell or `wait`.

    One database call starts the poll (the agent's node and its open commands); the waiter is
    registered after it, since only the token says which node rings it, so a ring for the node
    that came in between (doorbell.Listener.rang_since) makes it look once more. An idle poll may
    answer a little before `wait` (_idle_answer_s); the agent polls again at once. While the
    process hears the doorbell, a poll that waited out its time without a ring answers with
    nothing and no second query: a command issued meanwhile rang, and one whose ring was lost is
    found by the next poll's first query.
    """
    try:
        after, wait_s = _poll_arguments(request)
    except actions.Rejected as bad:
        try:  # an unknown agent hears 401 before it hears what is wrong with its arguments
            await sync_to_async(_authenticated_node)(request)
        except actions.Rejected as exc:
            return _error(exc.status, exc.errors)
        return _error(bad.status, bad.errors)
    bell = doorbell.listener()
    mark = bell.mark()
    try:
        node, found = await sync_to_async(_poll_start)(request, after)
    except actions.Rejected as exc:
        return _error(exc.status, exc.errors)
    if wait_s == 0 or found:
        return JsonResponse({"commands": found})

    deadline = time.monotonic() + _idle_answer_s(wait_s)
    # Set when the server lets go of this request (it stops: console.asgi.StopOnCancel).
    stop: asyncio.Event = getattr(request, "scope", {}).get("flexpipe.stop") or asyncio.Event()
    async with doorbell.waiting(node.node_id) as waiter:
        if bell.rang_since(mark, node.node_id):
            found = await sync_to_async(_deliver)(node, after)
        while not found and not stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            # Without a subscription (Redis away, or not subscribed yet) no ring comes: re-query every
            # RETRY_S; the listener's subscribing wakes the waiter too.
            reliable = waiter.reliable
            timeout = remaining if reliable else min(remaining, doorbell.RETRY_S)
            ring = asyncio.ensure_future(waiter.rung.wait())
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({ring, stopping}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            ring.cancel()
            stopping.cancel()
            if stop.is_set():
                break  # stopping: answer with nothing; the agent polls again after a restart
            if reliable and waiter.reliable and not waiter.rung.is_set():
                break  # waited out, heard throughout, no ring: nothing to look for (docstring)
            waiter.rung.clear()  # before the query: a ring during the query wakes the next wait
            found = await sync_to_async(_deliver)(node, after)
    return JsonResponse({"commands": found})


@csrf_exempt
@require_POST
def ack(request: HttpRequest, command_id: int) -> JsonResponse:
    try:
        node = _authenticated_node(request)
        body = parse_ack(_json_body(request))
        cmd = actions.do_ack_command(node, command_id, status=body.status, detail=body.detail,
                                     result=body.result, now=timezone.now())
    except SchemaError as exc:
        return _error(400, exc.errors)
    except actions.Rejected as exc:
        return _error(exc.status, exc.errors)
    flush_owed()  # as after a report: what a broker outage held back goes now
    return JsonResponse({"command": cmd.id, "status": cmd.state})
