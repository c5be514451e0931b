"""A PP2 torch plan across two node agents: stage 0 on node a, stage 1 on node b (its own process).

Node b is a real NodeAgent in a process of its own (remote_node.py, commands over a pipe), so its
stage worker can be told apart from node a's by process ancestry; node a is a NodeAgent in this
process. Engines are real (the tiny model, gloo on the CPU); nothing is mocked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agents.dataplane import PlanHost
from agents.engines.torch.engine import TorchEngine
from agents.engines.torch.group import EngineError
from agents.engines.torch.sampling import SamplingParams
from agents.node.daemon import NodeAgent
from agents.node.gpuspec import SpecProbe
from agents.node.plans import ModelStore, TorchBackend
from agents.protocol import check_result
from tests.agents.dataplane import conftest as dataplane
from tests.agents.dataplane.conftest import TinyModel, pid_alive
from tests.agents.dataplane.test_dataplane import PROMPT, follow, gen_body, move_when
from tests.agents.node.conftest import command, free_port, gpus, prepare_payload, tiny_plan

tiny_model = dataplane.tiny_model  # the data plane's fixtures, used here too
make_node = dataplane.make_node
GREEDY = SamplingParams(ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)


def ancestors(pid: int) -> list[int]:
    """`pid`'s parent, its parent, ... up to init (from /proc)."""
    out = []
    while pid > 1:
        with open(f"/proc/{pid}/stat") as fh:
            pid = int(fh.read().rsplit(") ", 1)[1].split()[1])
        out.append(pid)
    return out


class RemoteNode:
    """Node b: `python -m tests.agents.node.remote_node` with commands over its stdin."""

    def __init__(self, node_id: str, models_dir: Path) -> None:
        self.node_id = node_id
        self.addr = f"127.0.0.1:{free_port()}"
        root = Path(__file__).resolve().parents[3]
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.agents.node.remote_node", node_id, str(models_dir),
                                      self.addr], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root)
        assert self.proc.stdout is not None
        self.pid = json.loads(self.proc.stdout.readline())["ready"]
        self._ids = iter(range(10_000, 20_000))
        self._lock = threading.Lock()

    def handle(self, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self._lock:
            self.proc.stdin.write(json.dumps({"id": next(self._ids), "kind": kind, "payload": payload}) + "\n")
            self.proc.stdin.flush()
            ack: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return ack

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeAgent, RemoteNode]]:
    models = tmp_path_factory.mktemp("xhost-models")
    b = RemoteNode("b", models)
    addr = f"127.0.0.1:{free_port()}"
    a = NodeAgent(controller="http://127.0.0.1:9", join_token="fpj_unused", probe=SpecProbe("2xA100-80G", "a"),
                  backend=TorchBackend(ModelStore(models), addr, num_kv_blocks=64), backend_name="torch",
                  node_id="a", data_addr=addr)
    yield a, b
    a.close()
    b.close()


class CrossPlan:
    """One PP2 plan prepared on both nodes (the leader's prepare runs first and waits for b's)."""

    def __init__(self, a: NodeAgent, b: RemoteNode, kv_tokens: int) -> None:
        ga, gb = gpus("a", 1)[0], gpus("b", 1)[0]
        self.plan = tiny_plan([[ga], [gb]], kv_tokens=kv_tokens)
        node_of = {ga: "a", gb: "b"}
        self.a, self.b = a, b
        lead = {**prepare_payload(self.plan, "a", node_of=node_of), "peers": {"b": b.addr}}
        member = {**prepare_payload(self.plan, "b", node_of=node_of), "peers": {"a": a.data_addr or ""}}
        box: dict[str, Any] = {}
        t = threading.Thread(target=lambda: box.update(ack=a.handle(command("prepare_plan", lead))))
        t0 = time.perf_counter()
        t.start()  # the leader asks b before b has prepared: 409s, retried
        ack_b = b.handle("prepare_plan", member)
        t.join(120)
        self.prepare_s = time.perf_counter() - t0
        assert ack_b["status"] == "ok", ack_b
        assert box["ack"].status == "ok", box["ack"].detail
        slot = a.plans[("tiny", self.plan.plan_id)]
        assert slot.engine is not None
        self.host: PlanHost = slot.engine.host  # type: ignore[attr-defined]

    @property
    def engine(self) -> TorchEngine:
        assert self.host.engine is not None
        return self.host.engine

    def release(self) -> None:
        base = {"plan_id": self.plan.plan_id, "deployment": "tiny", "drain_timeout_s": 0}
        ack = self.a.handle(command("release_plan", base))
        assert ack.status == "ok", ack.detail
        ack_b = self.b.handle("release_plan", base)
        assert ack_b["status"] == "ok", ack_b
        check_result("release_plan", ack_b["result"])


@pytest.fixture(scope="module")
def cross(nodes: tuple[NodeAgent, RemoteNode]) -> Iterator[CrossPlan]:
    plan = CrossPlan(*nodes, kv_tokens=2048)
    yield plan
    pids = plan.engine.pids
    plan.release()
    deadline = time.monotonic() + 60
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if pid_alive(p)], "worker processes left running after release"


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_pp2_plan_across_two_nodes_generates_the_single_process_tokens(
        cross: CrossPlan, tiny_model: TinyModel, sampling: SamplingParams) -> None:
    n = 32
    t0 = time.perf_counter()
    seen = follow(cross.a.data_addr or "", gen_body(cross.host, f"x-{sampling.greedy}", n, sampling))
    dt = time.perf_counter() - t0
    assert seen.tokens == tiny_model.reference(PROMPT, n, sampling)
    print(f"\ncross-node PP2: {n / dt:.0f} tokens/s for one sequence (prepare {cross.prepare_s:.2f} s)")


def test_the_stage_1_worker_is_a_process_of_node_b_not_of_node_a(cross: CrossPlan) -> None:
    group = cross.engine._groups["main"]
    stage0, stage1 = group.pids
    assert group.names[1] == "flexpipe-main-s1t0@b"
    # node b's process is itself a child of this test process (node a): what tells them apart is
    # whether b's process is on the way up
    assert cross.b.pid in ancestors(stage1)
    assert os.getpid() in ancestors(stage0) and cross.b.pid not in ancestors(stage0)
    assert group.local_pids == [stage0]


def test_the_same_plan_in_one_process_tree_for_comparison(cross: CrossPlan, tiny_model: TinyModel,
                                                          make_node: Any) -> None:
    """Not a speed assertion: prints the one-tree PP2 rate beside the cross-node one."""
    node = make_node()
    local = node.run(tiny_model, cross.plan.to_dict())
    assert local.engine is not None and len(local.engine._groups["main"].local_pids) == 2
    n = 32
    t0 = time.perf_counter()
    seen = follow(node.addr, gen_body(local, "one-tree", n))
    dt = time.perf_counter() - t0
    assert seen.tokens == tiny_model.reference(PROMPT, n, GREEDY)
    print(f"\none-tree PP2: {n / dt:.0f} tokens/s for one sequence")


@pytest.mark.parametrize("action", ["migrate", "replay"])
def test_a_switch_to_and_from_the_cross_node_plan_keeps_the_tokens(
        cross: CrossPlan, tiny_model: TinyModel, make_node: Any, action: str) -> None:
    node = make_node()
    tp1 = node.run(tiny_model, tiny_plan([gpus("c", 1)]).to_dict())
    n = 48
    for src, src_addr, dst, dst_addr in ((tp1, node.addr, cross.host, cross.a.data_addr),
                                         (cross.host, cross.a.data_addr, tp1, node.addr)):
        sid = f"sw-{action}-{src.plan_id[:8]}"
        move = {"seq_id": sid, "action": action, "target_plan": dst.plan_id, "target_node": "x",
                "target_addr": dst_addr}
        on_token, box = move_when(src, sid, 5, lambda s=src, m=move: s.move([m], routing_version=7))
        seen = follow(src_addr or "", gen_body(src, sid, n, SEEDED), on_token)
        box["thread"].join(30)
        (moved,) = box["result"]["moved"]
        assert moved["ok"] and moved.get("outcome") != "gone", moved
        assert seen.tokens == tiny_model.reference(PROMPT, n, SEEDED)
        print(f"\n{action} {src.layout.describe()} -> {dst.layout.describe()}: client stall "
              f"{1000 * seen.stall_s[0]:.1f} ms, hand-over {1000 * moved['stall_s']:.1f} ms")


def test_the_stages_endpoint_refuses_an_unprepared_plan_and_names_a_bad_field(
        nodes: tuple[NodeAgent, RemoteNode]) -> None:
    _, b = nodes
    body = {"deployment": "tiny", "plan_id": "p-nothere", "group": "main", "ranks": [[1, 0]],
            "listener": "127.0.0.1:1", "authkey": "ab" * 32, "weights_sha256": "0" * 64, "timeout_s": 5}
    resp = httpx.post(f"http://{b.addr}/data/v1/stages", json=body)
    assert resp.status_code == 409 and resp.json()["reason"] == "not_prepared"
    for field, bad in (("ranks", [[1]]), ("authkey", "short"), ("group", "sideways"), ("timeout_s", -1)):
        resp = httpx.post(f"http://{b.addr}/data/v1/stages", json={**body, field: bad})
        assert resp.status_code == 400, resp.text
        assert resp.json()["param"].startswith(field), resp.json()


def test_a_killed_worker_on_node_b_fails_the_leader_s_group_naming_the_rank(
        nodes: tuple[NodeAgent, RemoteNode]) -> None:
    plan = CrossPlan(*nodes, kv_tokens=1024)  # its own plan: this one breaks
    remote_pid = plan.engine._groups["main"].pids[1]
    os.kill(remote_pid, signal.SIGKILL)
    t0 = time.perf_counter()
    seen = follow(plan.a.data_addr or "", gen_body(plan.host, "doomed", 8))
    assert time.perf_counter() - t0 < 60
    assert "error" in seen.ends[-1], seen.ends
    assert plan.host.state == "broken"
    assert "rank 1 (flexpipe-main-s1t0@b)" in plan.host.error
    with pytest.raises(EngineError, match="shut down"):
        plan.engine.step()
    plan.release()
