"""KV tiers in the simulator: what a plan's GPU prefix cache evicts goes to its node's host memory,
then SSD, then is dropped (LRU); the next turn of a conversation restores it instead of
recomputing its prefill, paying each tier's copy time; another model never hits; every sequence
stays accounted for."""

from __future__ import annotations

import pytest

from agents.schema import SchemaError
from agents.sim.fleet import FleetSim, SimOptions
from agents.sim.kvtiers import GIB, KvTierOptions, NodeTiers, TierView
from agents.sim.scenario import parse_scenario
from agents.sim.workload import Arrival
from scheduler.invariants import EventLog, check, summary
from scheduler.plan import Plan, Stage
from tests.agents.sim.worlds import one_deployment

BT = 512
TURN1 = tuple(range(100, 106))  # a conversation's first prompt: six 512-token blocks
OTHER = tuple(range(200, 208))  # another prompt of eight blocks: it evicts the first from the GPU
TURN2 = (*TURN1, 106, 107)  # the next turn: the first prompt, then two new blocks


def tiered(options: KvTierOptions | None, *, kv_tokens: int = 8 * BT + 64) -> tuple[FleetSim, object]:
    """One Llama-3-8B plan on an H100 whose GPU cache holds eight blocks."""
    sim = FleetSim(one_deployment(rate_rps=0), options=SimOptions(kv_tiers=options))
    base = sim.baseline_plan("d")
    plan = Plan(base.model, "colocated", base.stages, kv_reserve_tokens=kv_tokens)
    return sim, sim.launch("d", plan, source="warm", accepting=True)


def turns(sim: FleetSim) -> list[float]:
    """Turn 1, another prompt that pushes it off the GPU, turn 2: the TTFTs in that order."""
    for blocks in (TURN1, OTHER, TURN2):
        sim.submit("d", len(blocks) * BT, 4, blocks=blocks)
        sim.advance_to(sim.now_s + 30)
    return list(sim.recorder.f_ttft)


def test_a_restored_turn_prefills_shorter_than_a_recomputed_one_by_the_host_tiers_copy_time() -> None:
    off_sim, off_engine = tiered(None)
    on_sim, on_engine = tiered(KvTierOptions())
    off, on = turns(off_sim), turns(on_sim)
    prof = off_engine.profile.pipeline("prefill")  # type: ignore[attr-defined]
    view = on_engine.pipes[0].tiers  # type: ignore[attr-defined]
    assert isinstance(view, TierView) and view.use_host
    assert off[:2] == on[:2]  # nothing to restore yet: the same first two requests
    assert off[2] == pytest.approx(prof.prefill_time_s(8 * BT), rel=1e-9)  # recomputed whole
    copy_s = 6 * view.pcie_s_per_block
    new_prefill_s = prof.latency_interval(2 * BT, 1, 6 * BT)[0]  # the two new blocks, six in context
    assert on[2] == pytest.approx(copy_s + new_prefill_s, rel=1e-9)
    assert off[2] - on[2] == pytest.approx(off[2] - new_prefill_s - copy_s, rel=1e-9)
    assert 0 < copy_s < off[2] - new_prefill_s  # cheaper than the prefill it replaces, not free
    node = view.tiers
    assert node.restored_host_tokens == 6 * BT and node.restored_ssd_tokens == 0
    # turn 1's six blocks when the other prompt took the GPU cache, then its eight for turn 2's
    assert node.offloaded_blocks == 6 + 8


def test_an_ssd_restore_waits_for_the_drive_and_a_dear_tier_is_not_read() -> None:
    # a host tier too small for one block: every evicted block goes straight to the SSD
    block_bytes = BT * 131072  # Llama-3-8B: 128 KiB of KV per token (32 layers x 8 KV heads x 128 x 2 x 2 B)
    fast = KvTierOptions(host_kv_gib=block_bytes / 2 / GIB, ssd_read_bytes_per_s=1e12)
    sim, engine = tiered(fast)
    got = turns(sim)
    view = engine.pipes[0].tiers  # type: ignore[attr-defined]
    prof = engine.profile.pipeline("prefill")  # type: ignore[attr-defined]
    assert view.use_ssd and view.tiers.restored_ssd_tokens == 6 * BT
    ssd_s = 6 * (view.pcie_s_per_block + view.ssd_s_per_block)
    assert got[2] == pytest.approx(ssd_s + prof.latency_interval(2 * BT, 1, 6 * BT)[0], rel=1e-9)
    # an SSD slower than recomputing a block on this H100: the blocks are recomputed
    slow = KvTierOptions(host_kv_gib=block_bytes / 2 / GIB, ssd_read_bytes_per_s=1e8)
    sim, engine = tiered(slow)
    got = turns(sim)
    view = engine.pipes[0].tiers  # type: ignore[attr-defined]
    assert not view.use_ssd and view.tiers.restored_ssd_tokens == 0
    assert got[2] == pytest.approx(prof.prefill_time_s(8 * BT), rel=1e-9)


def test_tiers_off_by_default_leave_the_engines_as_they_were() -> None:
    sim, engine = tiered(None)
    assert sim.kv_tiers is None and engine.pipes[0].tiers is None  # type: ignore[attr-defined]
    assert engine.pipes[0].cache.spill is None  # type: ignore[attr-defined]


def test_eviction_goes_host_then_ssd_then_dropped_least_recent_first() -> None:
    node = NodeTiers("a1", host_bytes=2 * 10, ssd_bytes=2 * 10, ssd_read_bytes_per_s=1e9)
    node.offload("m", [1, 2, 3, 4, 5], 10)  # oldest first, as a GPU cache evicts
    assert [("m", h) in node.host for h in (4, 5)] == [True, True]
    assert [("m", h) in node.ssd for h in (2, 3)] == [True, True]
    assert ("m", 1) not in node.host and ("m", 1) not in node.ssd
    assert (node.offloaded_blocks, node.demoted_blocks, node.dropped_blocks) == (5, 3, 1)
    assert node.host.used_bytes == node.ssd.used_bytes == 20
    # a restore from the SSD brings the block up to the host tier, whose oldest goes down
    view = TierView(node, "m", block_tokens=1, block_bytes=10, pipe_kv_bytes_per_token=10,
                    pcie_bytes_per_s=1e9, recompute_s_per_block=1.0)
    n, seconds = view.restore((3, 9), 0, 2, t=0.0)
    assert n == 1 and seconds == pytest.approx(10 / 1e9 + 10 / 1e9)
    assert ("m", 3) in node.host and ("m", 4) in node.ssd and ("m", 3) not in node.ssd


def test_a_block_of_another_model_never_hits() -> None:
    node = NodeTiers("a1", host_bytes=1e6, ssd_bytes=1e6, ssd_read_bytes_per_s=1e9)
    views = {m: TierView(node, m, block_tokens=1, block_bytes=10, pipe_kv_bytes_per_token=10,
                         pcie_bytes_per_s=1e9, recompute_s_per_block=1.0) for m in ("Llama-3-8B", "Llama-2-7B")}
    views["Llama-3-8B"].offload([1, 2, 3])
    assert views["Llama-2-7B"].restore((1, 2, 3), 0, 3, t=0.0) == (0, 0.0)  # the same prompt, other weights
    assert views["Llama-3-8B"].restore((1, 2, 3), 0, 3, t=0.0)[0] == 3


def test_offload_and_restore_keep_every_sequence_accounted() -> None:
    scenario = one_deployment(rate_rps=0, duration_s=200)
    sim = FleetSim(scenario, options=SimOptions(kv_tiers=KvTierOptions()))
    sim.events = EventLog(record_decodes=True)
    base = sim.baseline_plan("d")
    sim.launch("d", Plan(base.model, "colocated", base.stages, kv_reserve_tokens=16 * BT), source="warm",
               accepting=True)
    # twenty conversations of five turns, interleaved: each turn's prompt is the last one plus a block
    arrivals = []
    for turn in range(5):
        for conv in range(20):
            blocks = tuple(1000 * conv + b for b in range(turn + 2))
            arrivals.append(Arrival(turn * 30.0 + conv * 0.5, "d", len(blocks) * BT, 16, blocks=blocks))
    sim.feed(arrivals)
    sim.run_to_completion()
    counts = summary(sim.events.events)
    assert counts["seq_admitted"] == counts["seq_finished"] == len(arrivals) and not sim.recorder.failed
    assert check(sim.events.events) == []
    assert sim.kv_tiers is not None
    totals = sim.kv_tiers.totals()
    assert totals["offloaded_blocks"] > 0 and totals["restored_host_tokens"] > 0


def test_a_node_sets_its_own_tier_sizes_and_bad_sizes_name_the_field() -> None:
    doc = {"name": "n", "seed": 1, "duration_s": 10,
           "nodes": [{"id": "a1", "gpu": "H100-SXM", "gpus": 8, "nvlink": True, "host_kv_gib": 64, "ssd_kv_gib": 0}],
           "network": {"intra_rack_gbps": 400, "inter_rack_gbps": 100},
           "models": [{"deployment": "d", "model": "Llama-3-8B", "slo": {"ttft_ms": 2000, "tpot_ms": 100},
                       "baseline": {"tp": 1, "nodes": ["a1"]}}],
           "workload": [{"deployment": "d", "arrival": "poisson", "rate_rps": 0,
                         "prompt_tokens": {"dist": "fixed", "value": 1}, "output_tokens": {"dist": "fixed", "value": 1}}]}
    sim = FleetSim(parse_scenario(doc), options=SimOptions(kv_tiers=KvTierOptions()))
    assert sim.kv_tiers is not None
    node = sim.kv_tiers.node("a1")
    assert node.host.capacity_bytes == 64 * GIB and node.ssd.capacity_bytes == 0
    doc["nodes"][0]["host_kv_gib"] = -1  # type: ignore[index]
    with pytest.raises(SchemaError, match=r"nodes\[0\]\.host_kv_gib"):
        parse_scenario(doc)
    with pytest.raises(ValueError, match="ssd_read_bytes_per_s"):
        KvTierOptions(ssd_read_bytes_per_s=0)


def test_another_models_request_on_the_same_node_never_restores_its_blocks() -> None:
    doc = {"name": "two", "seed": 1, "duration_s": 600,
           "nodes": [{"id": "a1", "gpu": "H100-SXM", "gpus": 8, "nvlink": True}],
           "network": {"intra_rack_gbps": 400, "inter_rack_gbps": 100},
           "models": [{"deployment": d, "model": m, "slo": {"ttft_ms": 2000, "tpot_ms": 100},
                       "baseline": {"tp": 1, "nodes": ["a1"]}} for d, m in (("a", "Llama-3-8B"), ("b", "Llama-2-7B"))],
           "workload": [{"deployment": "a", "arrival": "poisson", "rate_rps": 0,
                         "prompt_tokens": {"dist": "fixed", "value": 1}, "output_tokens": {"dist": "fixed", "value": 1}}]}
    sim = FleetSim(parse_scenario(doc), options=SimOptions(kv_tiers=KvTierOptions()))
    engines = {}
    for gpu, (dep, model) in enumerate((("a", "Llama-3-8B"), ("b", "Llama-2-7B"))):  # a GPU each
        stages = (Stage(0, 32, (sim.cluster.gpu_uuid("a1", gpu),)),)
        engines[dep] = sim.launch(dep, Plan(model, "colocated", stages, kv_reserve_tokens=8 * BT + 64),
                                  source="warm", accepting=True)
    assert {e.pipes[0].tiers.tiers.node for e in engines.values()} == {"a1"}  # one node's tiers, shared
    for dep, blocks in (("a", TURN1), ("a", OTHER), ("b", TURN2)):  # b's prompt starts with a's blocks
        sim.submit(dep, len(blocks) * BT, 4, blocks=blocks)
        sim.advance_to(sim.now_s + 30)
    node = engines["a"].pipes[0].tiers.tiers
    assert node.offloaded_blocks == 6 and node.restored_host_tokens == 0  # held for a, not given to b
    prof = engines["b"].profile.pipeline("prefill")
    assert sim.recorder.f_ttft[2] == pytest.approx(prof.prefill_time_s(8 * BT), rel=1e-9)  # recomputed
    sim.submit("a", len(TURN2) * BT, 4, blocks=TURN2)  # a's own next turn does restore them
    sim.advance_to(sim.now_s + 30)
    assert node.restored_host_tokens == 6 * BT
