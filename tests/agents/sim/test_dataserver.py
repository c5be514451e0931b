"""The simulated fleet's data plane speaks agents/dataplane's protocol; the tokens it streams are the ones
the simulator generates, when it generates them (agents/sim/dataserver.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agents.engines.torch.weights import write_tokenizer
from agents.sim.dataserver import SimDataPlane
from agents.sim.fleet import FleetSim, SimOptions
from scheduler.plan import Plan
from tests.agents.sim.worlds import one_deployment


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("sim-tok"), vocab_size=512, max_context=8192)


@pytest.fixture
def world(tokenizer: Path) -> Iterator[tuple[FleetSim, SimDataPlane, Plan]]:
    # nothing arrives from the scenario itself: only what the test sends
    sim = FleetSim(one_deployment(rate_rps=0.0, output={"dist": "fixed", "value": 40}),
                   options=SimOptions(max_run_rounds=4))
    plan = sim.baseline_plan("d")
    engine = sim.launch("d", plan, accepting=True, ready_in_s=0.0)
    sim.set_routing("d", {engine.engine_id: 1.0}, 1)
    plane = SimDataPlane(sim, str(tokenizer))
    plane.serve()
    yield sim, plane, plan
    plane.close()


def generate(addr: str, body: dict[str, Any], out: list[Any]) -> None:
    with httpx.Client(timeout=30) as c, c.stream("POST", f"http://{addr}/data/v1/generate", json=body) as r:
        out.append(r.status_code)
        if r.status_code != 200:
            out.append(json.loads(r.read()))
            return
        for line in r.iter_lines():
            if line.strip():
                out.append(json.loads(line))


def stepped(sim: FleetSim, plane: SimDataPlane, done: threading.Event, *, step_s: float = 0.01) -> list[float]:
    """Advance the simulator in small steps (pumping the plane) until the reader is done; the sim time
    at each step where new tokens went out."""
    seen: list[float] = []
    before = 0
    for _ in range(20_000):
        if done.is_set():
            break
        sim.advance_to(sim.now_s + step_s)
        plane.pump()
        streams = list(plane._live.values())
        made = sum(s.stream.generated for s in streams)
        if made != before:
            seen.append(sim.now_s)
            before = made
        done.wait(0.0005)
    return seen


def test_a_sequence_streams_the_tokens_the_simulator_generates_then_ends(world: Any) -> None:
    sim, plane, plan = world
    out: list[Any] = []
    body = {"deployment": "d", "plan_id": plan.plan_id, "seq_id": "s1", "prompt_ids": list(range(3, 300)),
            "max_tokens": 100, "sampling": {"seed": 7}, "routing_version": 1}
    reader = threading.Thread(target=generate, args=(plane.server.address, body, out))
    done = threading.Event()
    reader.start()
    threading.Thread(target=lambda: (reader.join(), done.set())).start()
    times = stepped(sim, plane, done)
    reader.join(10)
    assert out[0] == 200
    tokens = [e for e in out[1:] if "token" in e]
    assert [e["i"] for e in tokens] == list(range(40))  # the scenario's output length (under max_tokens)
    assert out[-1] == {"done": True, "finish_reason": "stop"}
    assert all(0 <= e["token"] < 512 for e in tokens)
    # the tokens went out over the simulated decode, step by step - not in one burst at the end
    assert len(times) >= 5 and times[-1] - times[0] > 0.05
    assert sim.engine_of("d", plan.plan_id).rep_arrivals == 1  # the engine counted it: its report will say so


def test_ignore_eos_generates_exactly_max_tokens_and_a_frozen_plan_is_refused_with_409(world: Any) -> None:
    sim, plane, plan = world
    out: list[Any] = []
    body = {"deployment": "d", "plan_id": plan.plan_id, "seq_id": "s2", "prompt_ids": [5, 6, 7],
            "max_tokens": 12, "sampling": {"ignore_eos": True}, "routing_version": 1}
    reader = threading.Thread(target=generate, args=(plane.server.address, body, out))
    done = threading.Event()
    reader.start()
    threading.Thread(target=lambda: (reader.join(), done.set())).start()
    stepped(sim, plane, done)
    reader.join(10)
    assert [e["i"] for e in out[1:] if "token" in e] == list(range(12))
    assert out[-1] == {"done": True, "finish_reason": "length"}

    sim.engine_of("d", plan.plan_id).accepting = False  # a switch froze it
    refused: list[Any] = []
    generate(plane.server.address, {**body, "seq_id": "s3"}, refused)
    assert refused[0] == 409 and refused[1]["reason"] == "frozen"
    unknown: list[Any] = []
    generate(plane.server.address, {**body, "seq_id": "s4", "plan_id": "p-0000000000000000"}, unknown)
    assert unknown[0] == 409 and unknown[1]["reason"] == "unknown_plan"
    bad: list[Any] = []
    generate(plane.server.address, {**body, "seq_id": "s5", "max_tokens": 0}, bad)
    assert bad[0] == 400 and bad[1]["param"] == "max_tokens"
