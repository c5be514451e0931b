"""How long one sequence stands still when a gear change hands it over: migrate vs replay.

    python -m bench.transition_stall

For Llama-2-7B and Llama-3-70B, a plan on one H100 node hands sequences of several context
lengths over to the same plan shape on another node, through the simulated agents
(agents.sim.world over agents.sim.fleet.FleetSim: the one simulator the replays, the live fleet
and the tests run) executing `move_sequences`
with the cost model's durations: a migration pauses the sequence at the end of its decode
iteration and moves its KV over the node link at the transition's bandwidth cap (half the
link, TransitionConfig.migrate_bw_share); a replay hands its tokens over and re-prefills them
on the target. The stall is from the pause to the first decode on the target.

Each sequence moves alone (a hand-over queued behind others would add their time). Printed
against a baseline measured in the same run: one decode iteration (TPOT) of the source plan at
that context - "/TPOT" is how many tokens' worth of time the sequence loses - and migrate
against replay, with the choice the transition's cost model makes for it (plan_moves).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from agents.sim.world import SimWorld
from scheduler.invariants import EventLog, assert_clean
from scheduler.modelspec import ModelSpec, model_spec
from scheduler.plan import Plan, Stage
from scheduler.topology import GpuState, LinkState, NodeState, Snapshot
from scheduler.transition import (
    DEFAULT_TRANSITION_CONFIG,
    CommandIntent,
    CommandKind,
    Route,
    SeqInfo,
    Step,
    plan_moves,
)
from scheduler.transition_memory import ManualClock, MemoryWorld

H100_BYTES = 80 * 10**9


@dataclass(frozen=True)
class Case:
    model: str
    tp: int
    contexts: tuple[int, ...]


CASES = (Case("Llama-2-7B", 1, (512, 2048, 4000)), Case("Llama-3-70B", 4, (512, 2048, 8000)))


def cluster(link_gbps: float) -> Snapshot:
    nodes, gpus = [], []
    for rack, node in (("A", "a1"), ("B", "b1")):
        nodes.append(NodeState(node, rack, True, 0.0))
        for i in range(8):
            gpus.append(GpuState(f"{node}-g{i}", node, i, "H100-SXM", H100_BYTES, 600 * 2**20, nvlink_group="0",
                                 last_seen_s=0.0))
    return Snapshot(now_s=0.0, nodes=tuple(nodes), gpus=tuple(gpus), links=(LinkState("a1", "b1", link_gbps),))


def plan_on(model: ModelSpec, node: str, tp: int) -> Plan:
    return Plan(model.name, "colocated", (Stage(0, model.num_layers, tuple(f"{node}-g{i}" for i in range(tp))),),
                kv_reserve_tokens=32_000)


def measure(case: Case, link_gbps: float, action: str, context: int) -> dict[str, object]:
    """Hand one sequence of about `context` tokens over with `action`, alone (no queue behind
    other hand-overs); what it cost."""
    model = model_spec(case.model)
    snap = cluster(link_gbps)
    log = EventLog()
    world = MemoryWorld(ManualClock(0.0), lambda: fleet.snapshot(), log)
    fleet = SimWorld(snap, world.agents, world.routing.current, log, seed=1)
    src, dst = plan_on(model, "a1", case.tp), plan_on(model, "b1", case.tp)
    for p in (src, dst):
        fleet.seed_plan(p, "bench")
    world.routing.seed("bench", [Route(src, 1.0, False, ("a1",)), Route(dst, 0.0, True, ("b1",))])
    prompt = context - 16
    # as long an output as its context allows: it is still decoding when it moves
    sid = fleet.submit("bench", prompt, min(4000, model.max_context_tokens - prompt))
    assert sid is not None
    req = fleet.sim.in_system[int(sid)]
    t = 0.0
    while req.first_token_s is None:
        t += 0.05
        fleet.advance_to(t)
    t += 0.1  # mid-decode: the hand-over waits for the end of the current iteration
    fleet.advance_to(t)
    bw_cap = snap.node_link_bytes_per_s("a1", "b1") * DEFAULT_TRANSITION_CONFIG.migrate_bw_share
    move: dict[str, object] = {"seq_id": sid, "action": action, "target_plan": dst.plan_id, "target_node": "b1",
                               "target_addr": "b1:7070", "bw_cap_bytes_per_s": bw_cap, "lazy": False,
                               "est_stall_s": 0.0}
    cmd = CommandIntent("bench/move", "a1", CommandKind.MOVE_SEQUENCES,
                        {"plan_id": src.plan_id, "deployment": "bench", "routing_version": 2, "moves": [move]},
                        "bench", 1, Step.MOVE, 1)
    world.agents.inject(cmd)
    while world.agents.results([cmd.key])[cmd.key].status not in ("ok", "failed"):
        t += 0.005
        fleet.advance_to(t)
    res = world.agents.results([cmd.key])[cmd.key]
    if res.status != "ok":
        raise RuntimeError(f"move_sequences failed: {res.detail}")
    fleet.advance_to(t + 0.5)
    assert_clean(log, complete=False)  # the hand-over kept invariants 1-2
    stall = next(x for x in fleet.stalls if x.seq_id == sid)
    engine = fleet.engine("bench", src.plan_id)
    assert engine is not None
    chosen = plan_moves([SeqInfo(sid, stall.context_tokens, 1, 1_000_000)], src, [(dst, 1.0)], model, snap,
                        drain_budget_s=0.0, bw_share=DEFAULT_TRANSITION_CONFIG.migrate_bw_share)[0]
    return {"context": stall.context_tokens, "stall_s": stall.stall_s, "kv_bytes": stall.kv_bytes,
            "tpot_s": engine.profile.pipeline("decode").decode_step_s(1, stall.context_tokens), "chosen": chosen.action,
            "est_s": chosen.est_stall_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transition_stall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--links", type=float, nargs="+", default=[100.0, 400.0],
                        help="node-to-node link speeds to try, Gb/s (default: 100 400)")
    args = parser.parse_args(argv)
    print(f"{'model':<12} {'TP':>2} {'link':>9} {'context':>7} {'KV moved':>9} {'TPOT':>7} | {'migrate':>8}"
          f" {'/TPOT':>6} | {'replay':>8} {'/TPOT':>6} | {'migrate/replay':>14} | {'cost model picks':>16}")
    for case in CASES:
        for gbps in args.links:
            for ctx in case.contexts:
                m = measure(case, gbps, "migrate", ctx)
                r = measure(case, gbps, "replay", ctx)
                tpot = float(m["tpot_s"])  # type: ignore[arg-type]
                ms, rs = float(m["stall_s"]), float(r["stall_s"])  # type: ignore[arg-type]
                print(f"{case.model:<12} {case.tp:>2} {gbps:>5.0f}Gb/s {m['context']:>7} "
                      f"{int(m['kv_bytes']) / 2**20:>7.0f}MB {tpot * 1e3:>5.1f}ms | {ms * 1e3:>6.1f}ms "  # type: ignore[call-overload]
                      f"{ms / tpot:>6.1f} | {rs * 1e3:>6.1f}ms {rs / tpot:>6.1f} | {ms / rs:>14.2f} | "
                      f"{m['chosen']:>16}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
