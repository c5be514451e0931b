"""The simulated fleet's data plane: agents/dataplane's protocol, served by the discrete-event simulator.

The gateway reaches a plan the same way whatever runs it: POST /data/v1/generate to the data
address of the plan's leader, then NDJSON tokens (agents/dataplane/server.py). For the live
simulated fleet (agents/sim/live.py) one `DataServer` serves every simulated plan - each node
registers its address - and `SimDataPlane` is what stands behind it instead of an engine:

* admitting a sequence on a plan (`SimPlan.admit`, a `HostedPlan`) submits one request to that
  plan in FleetSim (`FleetSim.submit_to`), with the prompt's token count and an output length
  the scenario's output distribution draws for the deployment (seeded by the sequence id),
  capped at max_tokens - exactly max_tokens with `ignore_eos`. 409 `unknown_plan` / `frozen`
  when the plan is not (or no longer) taking requests, as a real data server answers;
* every pass of the live fleet (`pump`) turns what the simulator generated since into token
  ids on the sequence's stream: the token counts, the time to the first token and between
  tokens are the simulator's (step times from scheduler.costmodel, batching, preemption, the
  hand-over at a switch - a sequence keeps its one stream wherever the simulator moves it). The
  ids themselves are synthetic: a passage of English encoded with the demo's tokenizer (made
  locally: agents/engines/torch/weights.write_tokenizer), so the text reads as words;
* the end: `{"done", "finish_reason": "stop"}` (the drawn length: as if the model stopped) or
  `"length"` (max_tokens), or `{"error"}` when the simulator failed the request (its plan lost
  GPUs and no plan took it over in time) - the gateway then resumes it elsewhere by replay.

Limits: a reader that goes away stops its stream, but the simulated request runs to its end (the
simulator has no cancel); hand-overs between plans happen inside the simulator, so /accept
refuses; one server for the whole fleet (its data network is one process).
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from agents.dataplane.errors import Frozen, Refused, UnknownPlan
from agents.dataplane.server import DataServer
from agents.dataplane.stream import SeqStream
from agents.sim.engine import Request
from agents.sim.fleet import FleetSim
from agents.sim.workload import sample_tokens

PASSAGE = (
    "The cluster is a set of fragments: GPUs of several generations, split into islands by other tenants, "
    "failures and tidal batch jobs. FlexPipe treats the execution plan of a model as a replaceable object "
    "and shifts gears at run time, weighing the gain against the switch cost, and never drops a request. "
    "Operators watch the heatmap, the switch timeline and the audit of every decision. "
)


@dataclass
class _Live:
    stream: SeqStream
    req: Request | None  # None until the fleet's pass submitted it
    deployment: str
    plan_id: str
    output: int  # tokens it will generate
    finish: str  # "stop" (drawn length) or "length" (max_tokens)
    offset: int  # where in the passage its ids start
    priority: int = 0  # the request's class (the gateway's `priority`): the simulated engine queues by it
    cancelled: bool = False


class SimDataPlane:
    """What the DataServer serves for the live simulated fleet (module docstring). `pump()` runs on the
    fleet's thread, between simulator steps; admissions come from the server's threads."""

    def __init__(self, sim: FleetSim, tokenizer_path: str, *, clock: Any = time.monotonic) -> None:
        from tokenizers import Tokenizer

        path = tokenizer_path if tokenizer_path.endswith(".json") else f"{tokenizer_path}/tokenizer.json"
        self.sim = sim
        self.ids = Tokenizer.from_file(path).encode(PASSAGE, add_special_tokens=False).ids
        self.clock = clock
        self._incoming: queue.Queue[_Live] = queue.Queue()
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self.server: DataServer | None = None

    # -- the server's side (any thread) ------------------------------------------------------------
    def plan(self, deployment: str, plan_id: str) -> SimPlan:
        if deployment not in self.sim.deployments or self.sim.engine_of(deployment, plan_id) is None:
            raise UnknownPlan(f"plan_id: {plan_id!r} of deployment {deployment!r} does not run in this fleet")
        return SimPlan(self, deployment, plan_id)

    def plans(self) -> list[SimPlan]:
        return [SimPlan(self, name, e.plan.plan_id) for name in self.sim.deployments for e in self.sim.plans(name)]

    def admit(self, deployment: str, plan_id: str, seq_id: str, prompt_tokens: int, max_tokens: int,
              sampling: Any, routing_version: int, priority: int = 0) -> SeqStream:
        engine = self.sim.engine_of(deployment, plan_id)
        if engine is None:
            raise UnknownPlan(f"plan_id: {plan_id!r} of deployment {deployment!r} does not run in this fleet")
        if engine.state != "serving" or not engine.accepting:
            raise Frozen(f"plan {plan_id} admits nothing new ({engine.state}{', frozen' if not engine.accepting else ''})")
        with self._lock:
            if seq_id in self._live:
                raise Refused(f"seq_id: {seq_id!r} is already admitted here")
        sampling = sampling if isinstance(sampling, dict) else {}
        rng = random.Random(f"{seq_id}:{sampling.get('seed')}")
        output, finish = max_tokens, "length"
        spec = next((w for w in self.sim.scenario.workload if w.deployment == deployment and w.output_tokens), None)
        if not sampling.get("ignore_eos") and spec is not None and spec.output_tokens is not None:
            drawn = sample_tokens(spec.output_tokens, rng)
            if drawn < max_tokens:
                output, finish = drawn, "stop"
        stream = SeqStream(seq_id, prompt_tokens, max_tokens, routing_version, self.clock())
        live = _Live(stream, None, deployment, plan_id, output, finish, rng.randrange(len(self.ids)), priority)
        with self._lock:
            self._live[seq_id] = live
        self._incoming.put(live)
        return stream

    def stream(self, seq_id: str) -> SeqStream | None:
        with self._lock:
            live = self._live.get(seq_id)
        return live.stream if live is not None else None

    def cancel(self, seq_id: str) -> bool:
        with self._lock:
            live = self._live.get(seq_id)
        if live is None:
            return False
        live.cancelled = True
        return True

    # -- the fleet's side (its thread, between simulator steps) ---------------------------------------
    @property
    def streaming(self) -> bool:
        """Some sequence is open: the fleet steps more often, so tokens arrive close to their sim time."""
        with self._lock:
            return bool(self._live)

    def pump(self) -> None:
        """Submit what was admitted since the last pass; give each open stream what the simulator made."""
        while True:
            try:
                live = self._incoming.get_nowait()
            except queue.Empty:
                break
            live.req = self.sim.submit_to(live.deployment, live.plan_id, live.stream.prompt_tokens, live.output,
                                          priority=live.priority)
            if live.req is None:
                self._end(live, {"error": f"plan {live.plan_id} stopped taking requests before {live.stream.seq_id} "
                                          "reached it"})
        with self._lock:
            open_ = list(self._live.values())
        now = self.clock()
        for live in open_:
            req = live.req
            if req is None:
                continue
            made = live.output if req.finish_s is not None else min(req.tokens_now(), live.output)
            for i in range(live.stream.generated, made):
                live.stream.append(self.ids[(live.offset + i) % len(self.ids)], now)
            if req.finish_s is not None:
                self._end(live, {"done": True, "finish_reason": live.finish})
            elif req.error is not None:
                self._end(live, {"error": f"sequence {live.stream.seq_id}: {req.error}"})
            elif live.cancelled:
                self._end(live, {"error": "cancelled: its reader went away"})

    def _end(self, live: _Live, end: dict[str, Any]) -> None:
        live.stream.close(end, self.clock())
        with self._lock:
            self._live.pop(live.stream.seq_id, None)

    # -- serving --------------------------------------------------------------------------------------
    def serve(self, host: str = "127.0.0.1", port: int = 0) -> DataServer:
        """Start the DataServer for this plane (port 0: any free one); its `address` is every node's."""
        self.server = SimDataServer(self, host, port).start()
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


class SimPlan:
    """One simulated plan as the DataServer sees it (a HostedPlan: admission, streams, state). The
    transition commands never reach it: the simulated agents carry them out on FleetSim."""

    model_sha256 = None  # a simulated plan holds no weights: hand-over frames are not checked here

    def __init__(self, plane: SimDataPlane, deployment: str, plan_id: str) -> None:
        self.plane, self.deployment, self.plan_id = plane, deployment, plan_id
        self._admitted = False  # the server looks a plan up per request: this one admitted its sequence

    @property
    def _engine(self) -> Any:
        return self.plane.sim.engine_of(self.deployment, self.plan_id)

    @property
    def state(self) -> str:
        if self._admitted:
            # the server writes the admitted stream while its host is "ready": here the sequence's
            # life is the simulator's - it outlives its plan when a switch moves it - and `pump` ends it
            return "ready"
        engine = self._engine
        return {"serving": "ready", "loading": "new"}.get(engine.state, "stopped") if engine is not None else "stopped"

    @property
    def frozen(self) -> bool:
        engine = self._engine
        return engine is None or not engine.accepting

    def admit(self, seq_id: str, prompt_ids: list[int], max_tokens: int, sampling: Any, *,
              routing_version: int = 0, priority: int = 0) -> SeqStream:
        stream = self.plane.admit(self.deployment, self.plan_id, seq_id, len(prompt_ids), max_tokens, sampling,
                                  routing_version, priority)
        self._admitted = True
        return stream

    def stream(self, seq_id: str) -> SeqStream | None:
        return self.plane.stream(seq_id)

    def cancel(self, seq_id: str) -> bool:
        return self.plane.cancel(seq_id)

    def accept(self, state: Any, lease: tuple[str, int], resume_from: int) -> None:
        raise Refused("hand-overs between simulated plans happen inside the simulator")


class SimDataServer(DataServer):
    """A DataServer whose plans are the simulator's, looked up as they are now (they come and go)."""

    def __init__(self, plane: SimDataPlane, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port)
        self.plane = plane

    def host(self, deployment: str, plan_id: str) -> Any:
        return self.plane.plan(deployment, plan_id)

    def hosts(self) -> list[Any]:
        return list(self.plane.plans())

    def find_stream(self, seq_id: str) -> tuple[Any, SeqStream] | None:
        stream = self.plane.stream(seq_id)
        if stream is None:
            return None
        return _Streaming(stream), stream


class _Streaming:
    """What the server's stream loop asks of a host while it writes a stream: alive, and cancel."""

    state = "ready"

    def __init__(self, stream: SeqStream) -> None:
        self._stream = stream

    def cancel(self, seq_id: str) -> bool:
        return False


__all__ = ["PASSAGE", "SimDataPlane", "SimDataServer", "SimPlan"]
