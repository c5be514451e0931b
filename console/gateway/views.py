"""The OpenAI-compatible endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models.

Async views (daphne/ASGI): the gateway holds one open stream per request and many requests at
once without a thread each. A request:

1. authenticates (`Authorization: Bearer fpu_...`, a user API token of any console role), parses
   its body (400 naming `param` on anything wrong: nothing is sent anywhere before), tokenizes
   with the deployment's own tokenizer - both on console.gateway.cpu's pool, never on the event
   loop, and a prompt too long for the context is refused before tokenizing;
2. routes with the one request router (routing.py over scheduler.router) among the deployment's
   routing table, to the chosen plan's leader node's data address; a plan that answers 429 passes
   it to the next of the router's order (its top-K, then its retry pool); while the table says a
   switch froze a route (or a leader says it is frozen), it waits up to
   FLEXPIPE_GATEWAY_FROZEN_WAIT_S for the new table; then 429 with Retry-After;
3. streams token ids from the data plane across hand-overs (upstream.py), detokenizes them
   incrementally and answers as SSE (`data: {...}` ... `data: [DONE]`) or as one JSON body;
4. when the plan fails mid-stream (its agent or node died: the stream breaks or ends with an
   error), resumes it on a plan of the routing table by replay - prompt plus the tokens already
   sent as the new prompt, the rest of max_tokens - waiting up to FLEXPIPE_GATEWAY_FAILOVER_WAIT_S
   for the gearbox to put a plan up, at most MAX_FAILOVERS times. Greedy decoding continues with
   exactly the tokens it would have made; a seeded sample continues validly but with fresh
   draws. Only then does the client get an error (nothing admitted is dropped silently).

A request of a deployment scaled to zero (its gear released after its idle time; console/gearbox/
zero.py) is held before step 2 - not refused, not lost: the gateway marks the deployment as having
a request waiting and asks for a tick (the control loop's rule 9 brings the baseline up), then
polls its routing table until a plan takes the request, for up to FLEXPIPE_GATEWAY_COLD_START_WAIT_S.
Nothing is streamed meanwhile (not even the headers): the first bytes are the first token's. After
the wait, 503 `cold_start_timeout` naming the deployment and the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import httpx
from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from agents import schema
from console.gateway import cpu, metrics, routing, tokens, upstream
from console.gateway.lookups import (
    _data_addr,
    _Deployment,
    _deployment,
    _models,
    _tokenizer_path,
    _user_for,
    _wake,
)
from console.gateway.requests import BadRequest, GenerateRequest, parse_chat, parse_completion
from console.gateway.routing import Candidate, any_frozen
from scheduler.router.spillover import Spilled

log = logging.getLogger(__name__)
OUTSTANDING: Counter[str] = Counter()  # plan_id -> requests this process has open on it
MAX_FAILOVERS = 3  # resumes of one request after its plan failed (step 4 of the module docstring)


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JsonResponse:
        resp = JsonResponse(self.body(), status=self.status)
        if self.retry_after_s is not None:
            resp["Retry-After"] = str(max(1, round(self.retry_after_s)))
        if self.status == 401:
            resp["WWW-Authenticate"] = 'Bearer realm="api"'
        return resp


def _setting(name: str, default: float) -> float:
    return float(getattr(settings, name, default))


# -- auth and parsing ----------------------------------------------------------------------------------


async def _authenticate(request: HttpRequest) -> Any:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, "send 'Authorization: Bearer fpu_...' with an API token of the console",
                       type_="authentication_error", code="missing_api_key")
    user = await sync_to_async(_user_for)(token)
    if user is None:
        raise ApiError(401, "unknown or revoked API token, or its user has no console role",
                       type_="authentication_error", code="invalid_api_key")
    return user


def _json_body_of(raw: bytes) -> Any:
    try:
        return schema.loads(raw)
    except schema.SchemaError as exc:
        raise ApiError(400, f"the body: {'; '.join(exc.errors.values())}") from None


def _bad(exc: BadRequest) -> ApiError:
    return ApiError(400, exc.message if exc.param is None else f"{exc.param}: {exc.message}", param=exc.param)


# -- admission -----------------------------------------------------------------------------------------


@dataclass
class Admitted:
    deployment: _Deployment
    route: Candidate
    resp: httpx.Response
    seq_id: str
    spill: Spilled | None = None  # KV spillover sent it away from its first choice: watched (routing.py)


def _dataplane_param(param: str | None) -> str | None:
    if param is None:
        return None
    return "prompt" if param.startswith("prompt_ids") else param


async def _route(req: GenerateRequest, dep: _Deployment, prompt_ids: list[int], max_tokens: int) -> routing.Routed:
    return await routing.order(dep.name, dep.model_name, dep.version, dep.routes, prompt_ids, max_tokens,
                               priority=req.priority, deadline_ms=req.deadline_ms, outstanding=OUTSTANDING,
                               slo_s=dep.slo_s)


async def _admit(req: GenerateRequest, dep: _Deployment, prompt_ids: list[int], max_tokens: int,
                 seq_id: str, *, routed: routing.Routed | None = None, key: str | None = None) -> Admitted:
    """Open the stream on one plan (module docstring, step 2). `routed`: the order to try first
    (a spillover timeout's re-route); `key`: the request's own id, when `seq_id` is another."""
    deadline = time.monotonic() + _setting("FLEXPIPE_GATEWAY_FROZEN_WAIT_S", 3.0)
    sampling = {"temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "ignore_eos": req.ignore_eos}
    first: routing.Routed | None = routed
    while True:
        retry_after: float | None = None
        frozen = any_frozen(dep.routes)
        routed, first = first or await _route(req, dep, prompt_ids, max_tokens), None
        for cand in routed.candidates:
            addr = await sync_to_async(_data_addr)(cand.leader)
            if not addr:
                continue
            body = {"deployment": dep.name, "plan_id": cand.plan_id, "seq_id": seq_id, "prompt_ids": prompt_ids,
                    "max_tokens": max_tokens, "sampling": sampling, "routing_version": dep.version}
            if req.priority:
                body["priority"] = req.priority
            try:
                resp = await upstream.open_generate(addr, body)
            except upstream.Refused as r:
                if r.status == 429:
                    retry_after = min(retry_after or r.retry_after_s, r.retry_after_s)
                elif r.status == 409:
                    frozen = True  # the leader froze before the table said so (or not prepared yet)
                else:
                    param = _dataplane_param(r.param)
                    raise ApiError(400, str(r).replace("prompt_ids", "prompt"), param=param) from None
                continue
            except httpx.HTTPError:
                continue  # the leader does not answer: try another plan
            spill = routing.admitted(routed, cand, seq_id, key=key)
            return Admitted(dep, cand, resp, seq_id, spill)
        if frozen and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            fresh = await sync_to_async(_deployment)(dep.name)
            dep = fresh or dep
            continue
        if retry_after is not None:
            raise ApiError(429, f"every plan of {dep.name} is saturated; retry after {retry_after:g} s",
                           type_="rate_limit_error", code="rate_limit_exceeded", retry_after_s=retry_after)
        raise ApiError(429, f"no plan of {dep.name} can take a request now (none routable"
                            f"{', a switch is in progress' if frozen else ''})",
                       type_="rate_limit_error", code="no_route", retry_after_s=1.0)


async def _admit_cold(job: _Job) -> Admitted:
    """Hold the request of a deployment at zero until its gear takes it (module docstring)."""
    name = job.dep.name
    wait_s = _setting("FLEXPIPE_GATEWAY_COLD_START_WAIT_S", 120.0)
    t0 = time.monotonic()
    outcome, signalled = "timeout", -1.0
    metrics.COLD_START_HELD.labels(name).inc()
    try:
        while True:
            now = time.monotonic()
            if now - signalled >= 1.0:  # the mark stays until the gear is back: renewing it is cheap
                signalled = now
                if await sync_to_async(_wake)(name):
                    metrics.COLD_STARTS.labels(name).inc()
            dep = await sync_to_async(_deployment)(name)
            if dep is None:
                outcome = "refused"
                raise ApiError(404, f"model: {name} was deleted while its request waited for it to scale up",
                               param="model", code="model_not_found")
            if any(isinstance(r, dict) and float(r.get("weight") or 0) > 0 for r in dep.routes):
                try:
                    adm = await _admit(job.req, dep, job.prompt_ids, job.max_tokens, job.id)
                except ApiError as exc:
                    if exc.status != 429 or time.monotonic() - t0 > wait_s:
                        outcome = "refused"
                        raise
                else:
                    job.dep, outcome = dep, "served"
                    return adm
            if time.monotonic() - t0 > wait_s:
                raise ApiError(503, f"model: {name} is scaled to zero and its gear did not come up within "
                                    f"{wait_s:g} s (FLEXPIPE_GATEWAY_COLD_START_WAIT_S); retry later",
                               type_="server_error", code="cold_start_timeout", retry_after_s=5.0)
            await asyncio.sleep(0.1)
    finally:
        metrics.COLD_START_HELD.labels(name).dec()
        metrics.COLD_START_WAIT.labels(name, outcome).observe(time.monotonic() - t0)


# -- the endpoints -------------------------------------------------------------------------------------


@dataclass
class _Job:
    endpoint: str  # "completions" | "chat"
    req: GenerateRequest
    dep: _Deployment
    tok: tokens.ModelTokenizer
    prompt_ids: list[int]
    max_tokens: int
    id: str
    created: int


def _parse(raw: bytes, endpoint: str) -> GenerateRequest:
    """The body as a request (CPU: run through console.gateway.cpu)."""
    body = _json_body_of(raw)
    try:
        return parse_completion(body) if endpoint == "completions" else parse_chat(body)
    except BadRequest as exc:
        raise _bad(exc) from None


def _prompt_limit(tok: tokens.ModelTokenizer) -> int:
    configured = int(getattr(settings, "FLEXPIPE_GATEWAY_MAX_PROMPT_CHARS", 0) or 0)
    return configured if configured > 0 else tok.max_prompt_chars()


def _prompt_ids(req: GenerateRequest, tok: tokens.ModelTokenizer, endpoint: str) -> list[int]:
    """The prompt as token ids (CPU: run through console.gateway.cpu). A text too long to fit the
    context is refused by its length, before tokenizing it (tokens.ModelTokenizer.max_prompt_chars)."""
    if req.prompt_ids is not None:
        if len(req.prompt_ids) > tok.max_context:
            raise ApiError(400, f"prompt: {len(req.prompt_ids)} token ids exceed the model's context of "
                                f"{tok.max_context}", param="prompt")
        prompt_ids = list(req.prompt_ids)
        vocab = tok.tokenizer.get_vocab_size()
        bad = next((i for i, t in enumerate(prompt_ids) if t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"prompt: token id {prompt_ids[bad]} at {bad} is outside the vocabulary ({vocab})",
                           param="prompt")
        return prompt_ids
    limit = _prompt_limit(tok)
    param = "prompt" if endpoint == "completions" else "messages"
    size = len(req.prompt_text) if req.prompt_text is not None else sum(len(m["content"]) for m in req.messages)
    if size > limit:
        raise ApiError(400, f"{param}: {size} characters cannot fit the model's context of {tok.max_context} "
                            f"tokens (at most {limit} characters are tokenized)", param=param)
    if req.prompt_text is not None:
        return tok.encode(req.prompt_text)
    return tok.encode(tok.chat_prompt(list(req.messages)))


async def _off_loop(fn: Any, *args: Any) -> Any:
    try:
        return await cpu.run(fn, *args)
    except cpu.Busy:
        raise ApiError(429, "the gateway is busy tokenizing other requests; retry shortly",
                       type_="rate_limit_error", code="gateway_busy", retry_after_s=1.0) from None


async def _prepare(request: HttpRequest, endpoint: str) -> _Job:
    await _authenticate(request)
    # parsing and tokenizing are CPU work: off daphne's event loop (console.gateway.cpu)
    req: GenerateRequest = await _off_loop(_parse, request.body, endpoint)
    dep = await sync_to_async(_deployment)(req.model)
    if dep is None:
        raise ApiError(404, f"model: no deployment is named {req.model!r} (GET /v1/models lists them)",
                       param="model", code="model_not_found")
    path = await sync_to_async(_tokenizer_path)(dep)
    if path is None:
        raise ApiError(503, f"model: no tokenizer is registered for {dep.model_name}", type_="server_error")
    try:
        tok = await _off_loop(tokens.load, path)
    except (OSError, ValueError) as exc:
        raise ApiError(503, f"model: the tokenizer of {dep.model_name} cannot be loaded: {exc}",
                       type_="server_error") from None
    prompt_ids: list[int] = await _off_loop(_prompt_ids, req, tok, endpoint)
    if not prompt_ids:
        raise ApiError(400, "prompt: it encodes to no tokens", param="prompt")
    context, whose = tok.max_context, "the model's context"
    if dep.max_context is not None and dep.max_context < context:
        context, whose = dep.max_context, f"the registered max_context of {dep.model_name} {dep.version_label}"
    room = context - len(prompt_ids)
    param = "max_tokens" if req.max_tokens is not None else ("prompt" if endpoint == "completions" else "messages")
    if room < 1 or (req.max_tokens is not None and req.max_tokens > room):
        raise ApiError(400, f"{param}: the prompt ({len(prompt_ids)} tokens) plus max_tokens "
                            f"({req.max_tokens}) exceeds {whose} ({context} tokens)", param=param)
    max_tokens = req.max_tokens if req.max_tokens is not None else room
    prefix = "cmpl" if endpoint == "completions" else "chatcmpl"
    return _Job(endpoint, req, dep, tok, prompt_ids, max_tokens, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))


def _usage(job: _Job, n_out: int) -> dict[str, int]:
    return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": n_out,
            "total_tokens": len(job.prompt_ids) + n_out}


def _choice(job: _Job, text: str, finish: str | None, ids: list[int] | None, *, first: bool = False,
            stream: bool) -> dict[str, Any]:
    c: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if job.endpoint == "completions":
        c.update(text=text, logprobs=None)
    elif stream:
        c["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
    else:
        c["message"] = {"role": "assistant", "content": text}
    if job.req.return_token_ids and ids is not None:
        c["token_ids"] = ids
    return c


def _envelope(job: _Job, choice: dict[str, Any], *, stream: bool) -> dict[str, Any]:
    obj = ("text_completion" if job.endpoint == "completions"
           else "chat.completion.chunk" if stream else "chat.completion")
    return {"id": job.id, "object": obj, "created": job.created, "model": job.dep.name, "choices": [choice]}


async def _resume(job: _Job, adm: Admitted, ids: list[int], why: str) -> None:
    """Step 4 of the module docstring: re-admit the rest of the request elsewhere, in place of `adm`.
    Raises UpstreamError when no plan takes it within the wait."""
    deadline = time.monotonic() + _setting("FLEXPIPE_GATEWAY_FAILOVER_WAIT_S", 30.0)
    seq_id = f"{job.id}-r{uuid.uuid4().hex[:8]}"
    while True:
        dep = await sync_to_async(_deployment)(job.dep.name) or job.dep
        try:
            new = await _admit(job.req, dep, job.prompt_ids + ids, job.max_tokens - len(ids), seq_id)
            break
        except ApiError as exc:
            if exc.status != 429 or time.monotonic() > deadline:
                raise upstream.UpstreamError(f"{why}; resuming it elsewhere failed: {exc}") from None
            await asyncio.sleep(0.25)
    _release(adm.route.plan_id)
    routing.done(adm.seq_id)
    OUTSTANDING[new.route.plan_id] += 1
    adm.route, adm.resp, adm.seq_id = new.route, new.resp, new.seq_id


async def _spill_wait(job: _Job, adm: Admitted, it: AsyncIterator[int]) -> tuple[int | None, bool]:
    """A spilled request's first token, waited for up to its spillover deadline (routing.py):
    (the token, False) when it came in time or the request keeps its place; (None, True) when it
    was re-routed - its stream closed, `adm` now the new plan's; (None, False) at a stream's end."""
    spill, adm.spill = adm.spill, None  # watched once
    assert spill is not None  # noqa: S101 - only called for a spilled admission
    nxt = asyncio.ensure_future(anext(it))
    done, _ = await asyncio.wait({nxt}, timeout=max(0.0, spill.deadline_s - time.monotonic()))
    if not done:
        fresh = await _route(job.req, job.dep, job.prompt_ids, job.max_tokens)
        target = routing.spill_timeout(spill, fresh)
        if target is not None and not nxt.done():
            nxt.cancel()  # closing the stream drops it from that engine: no token was sent
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await nxt
            try:
                new = await _admit(job.req, job.dep, job.prompt_ids, job.max_tokens,
                                   f"{job.id}-s{uuid.uuid4().hex[:8]}", routed=target, key=job.id)
            except ApiError as exc:
                raise upstream.UpstreamError(f"re-routing it after its spillover timeout failed: {exc}") from None
            log.info("gateway: %s: no first token on %s within the spillover timeout: re-routed to %s",
                     job.id, adm.route.plan_id, new.route.plan_id)
            _release(adm.route.plan_id)
            routing.done(adm.seq_id)
            OUTSTANDING[new.route.plan_id] += 1
            adm.route, adm.resp, adm.seq_id = new.route, new.resp, new.seq_id
            return None, True
    try:
        return await nxt, False
    except StopAsyncIteration:
        return None, False


async def _chain(first: int | None, it: AsyncIterator[int]) -> AsyncIterator[int]:
    if first is not None:
        yield first
    async for tid in it:
        yield tid


async def _pieces(job: _Job, adm: Admitted, info: upstream.Followed,
                  stats: dict[str, Any]) -> AsyncIterator[tuple[str, list[int]]]:
    """(text piece, ids) as tokens arrive, stop strings applied; sets stats["finish"]."""
    detok, stop = tokens.Detokenizer(job.tok), tokens.StopMatcher(job.req.stop)
    t0 = time.monotonic()
    ids: list[int] = stats.setdefault("ids", [])
    while True:
        try:
            async with aclosing(upstream.follow(adm.resp, adm.seq_id, info)) as stream:
                head = None
                if adm.spill is not None and not ids:
                    head, moved = await _spill_wait(job, adm, stream)
                    if moved:
                        continue  # follow the new plan's stream
                async for tid in _chain(head, stream):
                    now = time.monotonic()
                    if not ids:
                        stats["ttft_s"] = now - t0
                        stats["first_token_s"] = now
                        routing.first_token(adm.seq_id)
                    stats["last_s"] = now
                    ids.append(tid)
                    piece = stop.feed(detok.push(tid))
                    if stop.stopped:
                        stats["finish"] = "stop"
                        stats["n_out"] = len(ids)
                        yield piece, [tid]
                        return  # closing the stream tells the data plane to drop the sequence
                    if piece or job.req.return_token_ids:
                        yield piece, [tid]
            break
        except (upstream.UpstreamError, httpx.TransportError) as exc:
            why = f"plan {adm.route.plan_id} failed after {len(ids)} tokens: {exc or exc.__class__.__name__}"
            if len(info.failovers) >= MAX_FAILOVERS or len(ids) >= job.max_tokens:
                raise upstream.UpstreamError(why) from None
            log.warning("gateway: %s: %s; resuming it by replay on another plan", job.id, why)
            info.failovers.append(why)
            await _resume(job, adm, ids, why)
    stats["n_out"] = len(ids)
    tail = stop.feed(detok.flush())
    if not stop.stopped:
        tail += stop.flush()
    stats["finish"] = "stop" if stop.stopped or info.finish_reason == "stop" else "length"
    if tail:
        yield tail, []


def _observe(job: _Job, info: upstream.Followed, stats: dict[str, Any], status: int) -> None:
    name = job.dep.name
    metrics.REQUESTS.labels(name, job.endpoint, str(status)).inc()
    n_out = int(stats.get("n_out", 0))
    metrics.COMPLETION_TOKENS.labels(name).inc(n_out)
    if "ttft_s" in stats:
        metrics.TTFT.labels(name).observe(stats["ttft_s"])
        if n_out > 1:
            metrics.TPOT.labels(name).observe((stats["last_s"] - stats["first_token_s"]) / (n_out - 1))
    for stall in info.stalls_s:
        metrics.HANDOVERS.labels(name).inc()
        metrics.HANDOVER_STALL.labels(name).observe(stall)
    if info.failovers:
        metrics.FAILOVERS.labels(name).inc(len(info.failovers))
    metrics.RECORDER.finished(name, n_out)


async def _run(request: HttpRequest, endpoint: str) -> HttpResponse:
    job: _Job | None = None
    try:
        job = await _prepare(request, endpoint)
        if job.dep.at_zero and not job.dep.routes:
            adm = await _admit_cold(job)
        else:
            adm = await _admit(job.req, job.dep, job.prompt_ids, job.max_tokens, job.id)
    except ApiError as exc:
        name = job.dep.name if job is not None else "-"
        metrics.REQUESTS.labels(name, endpoint, str(exc.status)).inc()
        return exc.response()
    metrics.PROMPT_TOKENS.labels(job.dep.name).inc(len(job.prompt_ids))
    metrics.RECORDER.arrived(job.dep.name, len(job.prompt_ids))
    OUTSTANDING[adm.route.plan_id] += 1
    info = upstream.Followed()
    stats: dict[str, Any] = {}
    if job.req.stream:
        return StreamingHttpResponse(_sse(job, adm, info, stats), content_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _whole(job, adm, info, stats)


def _latencies(stats: dict[str, Any], status: int) -> dict[str, float | None]:
    """What the gateway measured of a finished request, for a learning router (routing.done)."""
    if status >= 500:
        return {"ttft_s": math.inf, "tpot_s": None}  # it failed: whatever came, it missed its objectives
    if "ttft_s" not in stats:
        return {"ttft_s": None, "tpot_s": None}
    n_out = int(stats.get("n_out", 0))
    tpot = (stats["last_s"] - stats["first_token_s"]) / (n_out - 1) if n_out > 1 else None
    return {"ttft_s": float(stats["ttft_s"]), "tpot_s": tpot}


def _release(plan_id: str) -> None:
    OUTSTANDING[plan_id] -= 1
    if OUTSTANDING[plan_id] <= 0:
        del OUTSTANDING[plan_id]


async def _finish(job: _Job, adm: Admitted, info: upstream.Followed, stats: dict[str, Any], status: int) -> None:
    _release(adm.route.plan_id)
    routing.done(adm.seq_id, **_latencies(stats, status))
    _observe(job, info, stats, status)
    await sync_to_async(metrics.record_load)(job.dep.name)


async def _whole(job: _Job, adm: Admitted, info: upstream.Followed, stats: dict[str, Any]) -> HttpResponse:
    texts: list[str] = []
    status = 200
    try:
        async for piece, _ in _pieces(job, adm, info, stats):
            texts.append(piece)
    except upstream.UpstreamError as exc:
        status = 502
        log.warning("gateway: %s on %s failed after admission: %s", job.id, adm.route.plan_id, exc)
        return ApiError(502, f"the data plane failed the request: {exc}", type_="server_error").response()
    finally:
        await _finish(job, adm, info, stats, status)
    ids = stats.get("ids", [])
    choice = _choice(job, "".join(texts), stats.get("finish", "length"), ids, stream=False)
    return JsonResponse({**_envelope(job, choice, stream=False), "usage": _usage(job, len(ids))})


def _sse_line(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _sse(job: _Job, adm: Admitted, info: upstream.Followed, stats: dict[str, Any]) -> AsyncIterator[bytes]:
    status = 200
    first = True
    try:
        async for piece, pids in _pieces(job, adm, info, stats):
            yield _sse_line(_envelope(job, _choice(job, piece, None, pids, first=first, stream=True), stream=True))
            first = False
        yield _sse_line(_envelope(job, _choice(job, "", stats.get("finish", "length"), [], first=first, stream=True),
                                  stream=True))
        if job.req.include_usage:
            yield _sse_line({**_envelope(job, {}, stream=True), "choices": [],
                             "usage": _usage(job, int(stats.get("n_out", 0)))})
    except upstream.UpstreamError as exc:
        status = 502
        log.warning("gateway: %s on %s failed after admission: %s", job.id, adm.route.plan_id, exc)
        yield _sse_line(ApiError(502, f"the data plane failed the request: {exc}", type_="server_error").body())
    finally:
        await _finish(job, adm, info, stats, status)
    yield b"data: [DONE]\n\n"


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return ApiError(405, "use POST").response()
    return await _run(request, "completions")


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return ApiError(405, "use POST").response()
    return await _run(request, "chat")


async def models(request: HttpRequest) -> HttpResponse:
    try:
        await _authenticate(request)
    except ApiError as exc:
        return exc.response()
    return JsonResponse({"object": "list", "data": await sync_to_async(_models)()})


@csrf_exempt
async def elsewhere(request: HttpRequest) -> HttpResponse:
    """Any /v1 path of the console's process when the gateway runs as its own (FLEXPIPE_PROCESS=console).

    421 Misdirected Request, not a redirect: clients strip the Authorization header when a redirect
    leaves the origin (another port is another origin), so a redirected request would arrive without
    its token; and the console must not serve a stream itself (the flood would share its process).
    """
    where = f"{settings.FLEXPIPE_GATEWAY_URL}/v1" if settings.FLEXPIPE_GATEWAY_URL else "the gateway's process"
    return ApiError(421, f"this is the console's process; the OpenAI API is served by the gateway at {where} "
                         "(console.gateway.asgi)", code="wrong_process").response()
