"""The daemon against a real console: live server over HTTP, a real Celery worker, real torch engines.

Nothing is called on the agent by hand: it enrolls, reports, long-polls; the console's gearbox
brings the tiny model's baseline up as a transition whose prepare_plan builds a torch plan on the
node; an operator's manual switch then moves a live sequence to a new plan on the other node.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from agents.engines.torch.sampling import SamplingParams
from agents.node.daemon import NodeAgent
from agents.protocol import check_result
from console.celery import app
from console.fleet.models import AgentCommand, Gpu, Node
from console.gearbox.actions import do_pin_gear, do_request_gear, do_sync_deployment
from console.gearbox.models import Deployment, Transition
from scheduler.plan import Gear
from tests.agents.engines.conftest import TinyModel
from tests.agents.node.conftest import MODEL, gpus, tiny_plan

JOIN = "fpj_node-test"
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]




@pytest.fixture
def console(live_server: Any, settings: Any) -> str:
    settings.FLEXPIPE_ENROLL_TOKEN = JOIN
    settings.FLEXPIPE_REPORT_INTERVAL_S = 1.0
    settings.FLEXPIPE_PREPARE_TIMEOUT_S = 120.0
    settings.FLEXPIPE_STEP_TIMEOUT_S = 30.0
    settings.FLEXPIPE_MOVE_TIMEOUT_S = 30.0
    # No drain budget: a sequence in flight at the switch moves (migrate) instead of finishing on
    # the old plan - the tiny model would finish any of them within a second.
    settings.FLEXPIPE_DRAIN_BUDGET_S = 0.0
    settings.FLEXPIPE_CANARY_DWELL_S = 0.2
    settings.FLEXPIPE_RETRY_BACKOFF_S = 0.2
    return str(live_server.url)


@pytest.fixture
def running(make_agent: Any, console: str) -> Iterator[Callable[..., NodeAgent]]:
    """Start agents on their own threads, as `python -m agents.node` runs them; stopped after."""
    threads: list[tuple[NodeAgent, threading.Thread]] = []

    def start(node_id: str, **kwargs: Any) -> NodeAgent:
        agent = make_agent(node_id, controller=console, token=JOIN, long_poll_s=1.0, **kwargs)
        t = threading.Thread(target=agent.run, name=f"agent-{node_id}", daemon=True)
        t.start()
        threads.append((agent, t))
        return agent

    yield start
    for agent, t in threads:
        agent.stop()
        t.join(timeout=10)


def wait_for(cond: Callable[[], object], max_s: float, what: str, story: Callable[[], str] = lambda: "") -> None:
    deadline = time.monotonic() + max_s
    last_sweep = 0.0
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {max_s} s. {story()}"
        if time.monotonic() - last_sweep > 1.0:  # what beat's sweep does
            app.send_task("transitions.sweep", queue=app.conf.task_default_queue)
            last_sweep = time.monotonic()
        time.sleep(0.1)


def story() -> str:
    return "; ".join(f"#{t.seq} {t.kind} {t.phase}/{t.step} {t.error[:120]}" for t in Transition.objects.order_by("id")) \
        + " | commands: " + "; ".join(f"{c.node.node_id} {c.kind} {c.state} {c.detail[:100]}"
                                      for c in AgentCommand.objects.select_related("node").order_by("id"))


def test_it_enrolls_with_its_own_token_and_reports_its_gpus(running: Callable[..., NodeAgent]) -> None:
    agent = running("n1")
    wait_for(lambda: Gpu.objects.filter(node__node_id="n1").exclude(updated_at=None).count() == 2, 20, "a report")
    node = Node.objects.get(node_id="n1")
    assert node.backends == ["torch"] and node.data_addr == agent.data_addr
    assert agent.client.token != JOIN
    assert set(Gpu.objects.filter(node=node).values_list("uuid", flat=True)) == set(gpus("n1"))


class Load:
    """Keeps `streams` sequences of one prompt in flight on a plan's leader, as a gateway would: each
    follows its stream across a hand-over ({"moved": ...} -> GET the stream at the target from the
    tokens it has). Stops admitting once the plan refuses (frozen)."""

    PROMPT = list(range(5, 25))
    MAX_TOKENS = 480  # prompt + output within the tiny model's 512 positions

    def __init__(self, addr: str, plan_id: str, streams: int = 8, max_tokens: int = MAX_TOKENS) -> None:
        self.addr, self.plan_id, self.max_tokens = addr, plan_id, max_tokens
        self.pool = ThreadPoolExecutor(max_workers=streams)
        self.futures: list[Future[dict[str, Any]]] = []
        self.refused = threading.Event()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.feeder = threading.Thread(target=self._feed, args=(streams,), daemon=True)
        self.feeder.start()

    def _feed(self, streams: int) -> None:
        while not (self.stop.is_set() or self.refused.is_set()):
            if sum(1 for f in self.futures if not f.done()) < streams:
                with self.lock:
                    if self.stop.is_set():
                        return
                    self.futures.append(self.pool.submit(self.one, f"s{next(self.ids)}"))
            else:
                time.sleep(0.005)

    def one(self, seq_id: str) -> dict[str, Any]:
        from agents.dataplane import Frozen
        from agents.dataplane.client import stream_tokens

        tokens: list[int] = []
        hops: list[str] = []
        read_at: list[int] = []  # tokens the reader had when each hop came
        body = {"deployment": "tiny", "plan_id": self.plan_id, "seq_id": seq_id, "prompt_ids": self.PROMPT,
                "max_tokens": self.max_tokens, "sampling": {"ignore_eos": True}}
        events = stream_tokens(self.addr, generate=body)
        try:
            while True:
                end = None
                for ev in events:
                    if "token" in ev:
                        assert ev["i"] == len(tokens), (seq_id, ev, len(tokens))
                        tokens.append(ev["token"])
                    else:
                        end = ev
                        break
                if end is not None and "moved" in end:
                    hops.append(end["moved"]["target_plan"])
                    read_at.append(len(tokens))
                    events = stream_tokens(end["moved"]["target_addr"], seq_id=seq_id, from_index=len(tokens))
                    continue
                return {"seq_id": seq_id, "tokens": tokens, "end": end, "hops": hops, "read_at": read_at}
        except Frozen:
            self.refused.set()
            return {"seq_id": seq_id, "refused": True}

    def results(self) -> list[dict[str, Any]]:
        with self.lock:
            self.stop.set()
        self.feeder.join(timeout=10)
        out = [f.result(timeout=60) for f in self.futures]
        self.pool.shutdown()
        return out


def test_the_gearbox_prepares_a_torch_plan_and_a_manual_switch_moves_live_sequences(
        running: Callable[..., NodeAgent], worker: None) -> None:
    pytest.importorskip("agents.dataplane")
    # TP2 plans: two worker processes and an all-reduce per layer make a decode iteration slow
    # enough on CPU that a 480-token sequence outlives the controller's freeze -> move round trip
    baseline = Gear(MODEL, (tiny_plan([gpus("n1", 2)]),), (1.0,))
    do_sync_deployment(name="tiny", model_name=MODEL, ttft_ms=2000, tpot_ms=200, priority=1, baseline=baseline,
                       actor="system:test")
    n1, n2 = running("n1"), running("n2")
    wait_for(lambda: Deployment.objects.get(name="tiny").current_gear, 120, "the baseline up", story)
    dep = Deployment.objects.get(name="tiny")
    assert Gear.from_dict(dep.current_gear).gear_id == baseline.gear_id
    old_id = baseline.plans[0].plan_id
    slot = n1.plans[("tiny", old_id)]
    assert slot.engine is not None and slot.role == "leader" and not n2.plans
    prepare = AgentCommand.objects.get(kind="prepare_plan", node__node_id="n1")
    assert prepare.state == "ok" and check_result("prepare_plan", prepare.result)["load_s"] > 0
    do_pin_gear("tiny", actor="system:test")  # only the operator moves it from here

    load = Load(n1.data_addr or "", old_id)
    wait_for(lambda: len(load.futures) >= 8, 20, "sequences in flight")
    target = Gear(MODEL, (tiny_plan([gpus("n2", 2)]),), (1.0,))
    _, started = do_request_gear("tiny", target, actor="system:test", reason="move to n2")
    assert started is not None, story()
    wait_for(lambda: Transition.objects.get(deployment__name="tiny", seq=started.seq).phase == "done", 120,
             "the switch", story)
    results = load.results()

    new_id = target.plans[0].plan_id
    # the engine reports of the plans the nodes run reach the console with the node's report
    wait_for(lambda: any(e["plan_id"] == new_id for e in Node.objects.get(node_id="n2").engines), 10,
             "n2's engine report")
    assert ("tiny", new_id) in n2.plans and ("tiny", old_id) not in n1.plans
    for c in AgentCommand.objects.filter(state="ok"):
        check_result(c.kind, c.result)
    served = [r for r in results if not r.get("refused")]
    moved = [r for r in served if r["hops"]]
    frozen = AgentCommand.objects.get(kind="freeze_plan", node__node_id="n1").result
    move = AgentCommand.objects.filter(kind="move_sequences", node__node_id="n1").order_by("id").last()
    assert move is not None and move.state == "ok", story()
    assert moved, f"no sequence was moved: {len(served)} served; frozen with {frozen}; moves {move.payload} {move.result}"
    # nothing admitted is lost, and a moved sequence says exactly what an unmoved one says (greedy)
    assert all(r["end"] == {"done": True, "finish_reason": "length"} for r in served), [r["end"] for r in served]
    fresh = Load(n2.data_addr or "", new_id, streams=1)
    wait_for(lambda: fresh.futures and fresh.futures[0].done(), 30, "a sequence on the new plan")
    reference = fresh.results()[0]["tokens"]
    assert len(reference) == Load.MAX_TOKENS
    at = {m["seq_id"]: m.get("context_tokens", 0) - len(Load.PROMPT) for m in move.result["moved"]}
    differ = [(r["seq_id"], r["read_at"], at.get(r["seq_id"]),
               next(i for i, (a, b) in enumerate(zip(r["tokens"], reference, strict=True)) if a != b))
              for r in served if r["tokens"] != reference]
    assert not differ, f"(seq, reader had, moved after token, first differing token): {differ}"
    assert all(r["hops"] == [new_id] for r in moved), [r["hops"] for r in moved]
    assert {m["seq_id"] for m in move.result["moved"] if "outcome" not in m} == {r["seq_id"] for r in moved}


def test_an_agent_that_restarts_without_its_plan_gets_one_back_from_the_gearbox(
        running: Callable[..., NodeAgent], worker: None) -> None:
    from console.audit.models import AuditEntry

    baseline = Gear(MODEL, (tiny_plan([gpus("n1", 1)]),), (1.0,))
    do_sync_deployment(name="tiny", model_name=MODEL, ttft_ms=2000, tpot_ms=200, priority=1, baseline=baseline,
                       actor="system:test")
    first = running("n1")
    wait_for(lambda: Deployment.objects.get(name="tiny").current_gear, 120, "the baseline up", story)
    pid = baseline.plans[0].plan_id
    assert first.plans[("tiny", pid)].engine is not None

    first.close()  # the daemon dies, and its engines with it; a new one starts on the node
    restarted = time.monotonic()
    again = running("n1")

    def serving() -> bool:
        slot = again.plans.get(("tiny", pid))
        return slot is not None and slot.engine is not None and Deployment.objects.get(name="tiny").current_gear
    wait_for(serving, 120, "the plan prepared again on the new agent", story)
    print(f"\nagent restart -> its plan serving again: {time.monotonic() - restarted:.1f} s")
    assert AuditEntry.objects.filter(event_type="fleet.plans_lost").count() == 1
    assert AuditEntry.objects.filter(event_type="gearbox.plans_lost").count() == 1
    routes = Deployment.objects.get(name="tiny").routing
    assert [(r["plan_id"], r["nodes"]) for r in routes] == [(pid, ["n1"])]
    load = Load(again.data_addr or "", pid, streams=1)
    wait_for(lambda: load.futures and load.futures[0].done(), 30, "a sequence on the plan brought back")
    result = load.results()[0]
    assert result["end"] == {"done": True, "finish_reason": "length"} and len(result["tokens"]) == Load.MAX_TOKENS


def test_the_gearbox_brings_up_a_plan_whose_stages_are_on_two_nodes_and_it_serves(
        running: Callable[..., NodeAgent], worker: None, tiny_model: TinyModel) -> None:
    baseline = Gear(MODEL, (tiny_plan([gpus("n1", 1), gpus("n2", 1)]),), (1.0,))
    do_sync_deployment(name="tiny", model_name=MODEL, ttft_ms=2000, tpot_ms=200, priority=1, baseline=baseline,
                       actor="system:test")
    n1, n2 = running("n1"), running("n2")
    wait_for(lambda: Deployment.objects.get(name="tiny").current_gear, 120, "the cross-node baseline up", story)
    pid = baseline.plans[0].plan_id
    assert n1.plans[("tiny", pid)].role == "leader" and n2.plans[("tiny", pid)].role == "member"
    prepares = AgentCommand.objects.filter(kind="prepare_plan").order_by("node__node_id")
    assert [(c.node.node_id, c.state) for c in prepares] == [("n1", "ok"), ("n2", "ok")]
    # 96 tokens, not 480: the reference recomputes the whole sequence per token (O(n^3) in all), and
    # a 480-token one took 60 s of this test's 70; nothing moves here, so a short one shows as much
    load = Load(n1.data_addr or "", pid, streams=1, max_tokens=96)
    wait_for(lambda: load.futures and load.futures[0].done(), 60, "a sequence on the cross-node plan")
    result = load.results()[0]
    reference = tiny_model.reference(Load.PROMPT, 96, SamplingParams(ignore_eos=True))
    assert result["end"] == {"done": True, "finish_reason": "length"} and result["tokens"] == reference


def test_a_node_on_the_nvml_probe_registers_what_nvml_recorded(console: str) -> None:
    from pathlib import Path

    from agents.probes.nvml import NvmlProbe
    from agents.probes.nvml_replay import RecordedNvml

    fixture = Path(__file__).parents[1] / "probes" / "fixtures" / "nvml_hgx_h100_8gpu.json"
    probe = NvmlProbe.open(RecordedNvml.from_file(fixture))
    # as `python -m agents.node --probe nvml` builds it: memory as NVML measures it, nothing booked on top
    agent = NodeAgent(controller=console, join_token=JOIN, probe=probe, backend=None, backend_name="torch",
                      node_id="hgx1", data_addr="127.0.0.1:7999", long_poll_s=0, book_memory=False)
    try:
        agent.step()
        rows = Gpu.objects.filter(node__node_id="hgx1")
        assert rows.count() == 8 and set(rows.values_list("model", flat=True)) == {"H100-SXM"}
        assert len(set(rows.values_list("nvlink_group", flat=True))) == 1
        measured = {g.uuid: g.mem_used_bytes for g in probe.report()}
        assert {g.uuid: g.mem_used_bytes for g in rows} == measured
    finally:
        agent.close()
