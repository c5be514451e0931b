"""The daemon's command handling without a controller: idempotency, undo of what never ran,
GPU and memory checks, acks that agents.protocol.check_result accepts."""

from __future__ import annotations

from typing import Any

from agents.protocol import check_result
from scheduler.booking import refuse_booking
from tests.agents.node.conftest import MODEL, command, gpus, prepare_payload, tiny_plan


def ok(kind: str, ack: Any) -> dict[str, Any]:
    assert ack.status == "ok", ack.detail
    return check_result(kind, ack.result)


def test_a_member_books_its_gpus_memory_and_reports_it_as_used(make_agent: Any) -> None:
    agent = make_agent("n2")
    a, b = gpus("n1", 1)[0], gpus("n2", 1)[0]
    plan = tiny_plan([[a], [b]])
    payload = prepare_payload(plan, "n2", reserve_bytes=3 * 2**30, node_of={a: "n1", b: "n2"})
    assert payload["role"] == "member"
    result = ok("prepare_plan", agent.handle(command("prepare_plan", payload)))
    assert result["reserved_bytes"] == {b: 3 * 2**30}
    used = {g.uuid: g.mem_used_bytes for g in agent.gpu_reports()}
    assert used[b] == 3 * 2**30 and used[gpus("n2")[1]] == 0
    assert agent.plans[("tiny", plan.plan_id)].engine is None  # a member runs no engine


def test_the_same_command_twice_runs_once(make_agent: Any) -> None:
    agent = make_agent("n2")
    a, b = gpus("n1", 1)[0], gpus("n2", 1)[0]
    plan = tiny_plan([[a], [b]])
    cmd = command("prepare_plan", prepare_payload(plan, "n2", node_of={a: "n1", b: "n2"}))
    first = agent.handle(cmd)
    again = agent.handle(cmd)
    assert again is first and agent.executed["prepare_plan"] == 1
    release = command("release_plan", {"plan_id": plan.plan_id, "deployment": "tiny", "drain_timeout_s": 0})
    freed = ok("release_plan", agent.handle(release))
    assert freed["freed_bytes"] == 2 * 2**30 and not freed.get("noop")
    assert agent.handle(release) is agent.acks[release.id] and agent.executed["release_plan"] == 1
    assert agent.booked() == {}


def test_a_retry_with_a_new_id_of_a_prepared_plan_acks_at_once(make_agent: Any) -> None:
    agent = make_agent("n2")
    a, b = gpus("n1", 1)[0], gpus("n2", 1)[0]
    payload = prepare_payload(tiny_plan([[a], [b]]), "n2", node_of={a: "n1", b: "n2"})
    ok("prepare_plan", agent.handle(command("prepare_plan", payload)))
    retry = ok("prepare_plan", agent.handle(command("prepare_plan", payload)))
    assert retry["already"] is True
    assert agent.booked() == {b: 2 * 2**30}  # booked once, not twice


def test_undo_commands_for_a_plan_that_never_ran_are_noops(make_agent: Any) -> None:
    agent = make_agent()
    plan_id = tiny_plan([gpus("n1", 1)]).plan_id
    base = {"plan_id": plan_id, "deployment": "tiny"}
    assert ok("abort_plan", agent.handle(command("abort_plan", {**base, "reason": "rollback"})))["noop"] is True
    assert ok("thaw_plan", agent.handle(command("thaw_plan", base)))["noop"] is True
    assert ok("release_plan", agent.handle(command("release_plan", base)))["freed_bytes"] == 0
    frozen = ok("freeze_plan", agent.handle(command("freeze_plan", {**base, "routing_version": 3})))
    assert frozen["sequences"] == []
    moved = ok("move_sequences", agent.handle(command("move_sequences", {
        **base, "routing_version": 4, "moves": [
            {"seq_id": "s1", "action": "migrate", "target_plan": "p-x", "target_node": "n2",
             "target_addr": "127.0.0.1:1"}]})))
    assert moved["moved"] == [{"seq_id": "s1", "action": "migrate", "ok": True, "outcome": "gone",
                               "context_tokens": 0, "kv_bytes": 0, "replay_tokens": 0, "stall_s": 0.0}]


def test_gpus_of_another_node_are_refused_as_preempted(make_agent: Any) -> None:
    agent = make_agent("n1")
    plan = tiny_plan([gpus("elsewhere", 1)])
    ack = agent.handle(command("prepare_plan", prepare_payload(plan, "n1")))
    assert ack.status == "failed" and ack.result["reason"] == "preempted"
    assert ack.result["gpus"] == gpus("elsewhere", 1)
    assert agent.booked() == {}


def test_a_plan_that_would_book_over_92_percent_beside_another_is_refused_out_of_memory(make_agent: Any) -> None:
    agent = make_agent("n2")
    a, b = gpus("n1", 1)[0], gpus("n2", 1)[0]
    node_of = {a: "n1", b: "n2"}
    first = prepare_payload(tiny_plan([[a], [b]]), "n2", reserve_bytes=60 * 10**9, node_of=node_of)
    ok("prepare_plan", agent.handle(command("prepare_plan", first)))
    # 60 GB + 15 GB fits in 80 GiB's 100% but not in its 92%: the old check let it through
    second = prepare_payload(tiny_plan([[a], [b]], kv_tokens=4096), "n2", reserve_bytes=15 * 10**9, node_of=node_of)
    ack = agent.handle(command("prepare_plan", second))
    total = agent.probe.report()[0].mem_total_bytes
    used = next(g.mem_used_bytes for g in agent.probe.report() if g.uuid == b) + 60 * 10**9
    # the words every agent refuses with (scheduler.booking): the simulated fleets send the same
    expected = refuse_booking({b: 15 * 10**9}, {b: used}, {b: total})
    assert expected is not None
    assert ack.status == "failed" and ack.result["reason"] == "out_of_memory" and ack.result["gpus"] == [b]
    assert ack.detail == expected.message() and "above the 92% limit" in ack.detail
    assert agent.booked() == {b: 60 * 10**9}


def test_the_same_plan_for_two_deployments_is_two_plans_each_booked_and_released_alone(make_agent: Any) -> None:
    # plan ids are content hashes: two deployments of one model may be given the same plan; the
    # daemon keys plans by (deployment, plan_id), and so does the simulator (tests/agents/sim/test_simagents.py)
    agent = make_agent("n2")
    a, b = gpus("n1", 1)[0], gpus("n2", 1)[0]
    plan = tiny_plan([[a], [b]])
    node_of = {a: "n1", b: "n2"}
    for dep in ("tiny", "tiny-batch"):
        payload = prepare_payload(plan, "n2", deployment=dep, reserve_bytes=30 * 10**9, node_of=node_of)
        result = ok("prepare_plan", agent.handle(command("prepare_plan", payload, deployment=dep)))
        assert "already" not in result
    assert agent.booked() == {b: 60 * 10**9}
    release = {"plan_id": plan.plan_id, "deployment": "tiny-batch", "drain_timeout_s": 0}
    assert ok("release_plan", agent.handle(command("release_plan", release, deployment="tiny-batch")))["freed_bytes"] \
        == 30 * 10**9
    assert agent.booked() == {b: 30 * 10**9} and ("tiny", plan.plan_id) in agent.plans


def test_a_bad_payload_is_refused_naming_the_field(make_agent: Any) -> None:
    agent = make_agent()
    ack = agent.handle(command("freeze_plan", {"plan_id": "p-1", "deployment": "tiny", "routing_version": -1}))
    assert ack.status == "failed" and "payload.routing_version" in ack.detail and ack.result["reason"] == "failed"
    ack = agent.handle(command("teleport", {}))
    assert ack.status == "failed" and "kind" in ack.detail


def test_a_leader_with_weights_other_than_the_registry_s_fails_and_books_nothing(make_agent: Any) -> None:
    agent = make_agent("n1")
    plan = tiny_plan([gpus("n1", 1)])
    ack = agent.handle(command("prepare_plan", prepare_payload(plan, "n1", weights_sha256="0" * 64)))
    assert ack.status == "failed" and ack.result["reason"] == "failed" and "sha256" in ack.detail
    # the digest the node found travels in the ack (the registry quarantines the version on it)
    assert set(ack.result) == {"reason", "weights_sha256"} and len(ack.result["weights_sha256"]) == 64
    assert ack.result["weights_sha256"] != "0" * 64
    assert agent.booked() == {} and not agent.plans


def test_on_a_gpu_node_a_plan_s_gpus_become_cuda_indexes_in_rank_order(models_dir: Any) -> None:
    from agents.node.plans import ModelStore, TorchBackend

    a, b, c = gpus("n1", 3)
    backend = TorchBackend(ModelStore(models_dir), "127.0.0.1:1", device="cuda", gpu_index={a: 4, b: 1, c: 0})
    plan = tiny_plan([[b, a], [c]]).to_dict()
    assert backend.cuda_indexes(plan) == [1, 4, 0]
    assert backend.cuda_indexes(tiny_plan([gpus("elsewhere", 1)]).to_dict()) is None


def test_a_plan_on_one_node_gets_no_placement_and_a_split_one_asks_its_peers(models_dir: Any) -> None:
    from agents.node.plans import ModelStore, TorchBackend

    backend = TorchBackend(ModelStore(models_dir), "127.0.0.1:1")
    a, b = gpus("n1", 1)[0], gpus("n2", 1)[0]
    one = tiny_plan([[a], [gpus("n1")[1]]])
    here = prepare_payload(one, "n1")
    # every rank here: the one-node path (no listener), whatever peers say
    assert backend.placement("tiny", one.to_dict(), one.plan_id, "0" * 64, here["stages"], {"n2": "h:1"}) is None
    split = tiny_plan([[a], [b]])
    lead = prepare_payload(split, "n1", node_of={a: "n1", b: "n2"})
    assert backend.placement("tiny", split.to_dict(), split.plan_id, "0" * 64, lead["stages"], {}) is None
    placed = backend.placement("tiny", split.to_dict(), split.plan_id, "0" * 64, lead["stages"], {"n2": "h:7"})
    assert placed is not None and set(placed) == {"main"}
    main = placed["main"]
    assert main.local == {0} and main.bind_host == "127.0.0.1"
    assert [(s.name, s.addr) for s in main.sites] == [("n2", "h:7")]


def verify_payload(name: str, sha256: str) -> dict[str, Any]:
    return {"model_version_id": 1, "name": name, "version": "v1", "weights_uri": "hf://org/m/model.safetensors",
            "sha256": sha256, "engine": "torch", "tokenizer": "hf://org/m/tokenizer.json"}


def test_verify_weights_hashes_the_model_the_node_holds_and_says_its_digest(make_agent: Any, tmp_path: Any) -> None:
    from agents.engines.torch.weights import make_tiny_llama
    from agents.node.plans import ModelStore

    digest = make_tiny_llama(tmp_path / "tiny-llama")
    agent = make_agent()
    agent.backend.models = ModelStore(tmp_path)
    same = agent.handle(command("verify_weights", verify_payload("tiny-llama", digest)))
    assert ok("verify_weights", same) == {"sha256": digest} and "the registry's" in same.detail
    other = agent.handle(command("verify_weights", verify_payload("tiny-llama", "0" * 64)))
    assert ok("verify_weights", other) == {"sha256": digest} and "not the registry's" in other.detail
    assert agent.executed["verify_weights"] == 2 and not agent.plans and agent.booked() == {}


def test_verify_weights_of_a_model_the_node_lacks_fails_naming_the_model_and_the_folder(make_agent: Any,
                                                                                       tmp_path: Any) -> None:
    from agents.node.plans import ModelStore

    agent = make_agent()
    agent.backend.models = ModelStore(tmp_path)
    ack = agent.handle(command("verify_weights", verify_payload("tiny-llama", "0" * 64)))
    assert ack.status == "failed" and ack.result == {"reason": "failed"}
    assert "'tiny-llama'" in ack.detail and str(tmp_path / "tiny-llama") in ack.detail
    assert not (tmp_path / "tiny-llama").exists()  # a check makes nothing, not even the tiny model


def test_verify_weights_takes_no_plan_lock_and_a_node_without_models_refuses_it(make_agent: Any) -> None:
    agent = make_agent(backend=False)
    ack = agent.handle(command("verify_weights", verify_payload("tiny-llama", "0" * 64)))
    assert ack.status == "failed" and "holds no model store" in ack.detail and "'tiny-llama'" in ack.detail
    assert agent._plan_locks == {}
    bad = agent.handle(command("verify_weights", {**verify_payload("tiny-llama", "0" * 64), "sha256": "x"}))
    assert bad.status == "failed" and "payload.sha256" in bad.detail


def test_a_plan_its_engine_cannot_run_is_refused_in_the_planners_words(make_agent: Any) -> None:
    from dataclasses import replace as dc_replace

    from scheduler.capabilities import TORCH_CAPS, engine_refusals
    from scheduler.plan import Plan, Stage

    agent = make_agent("n1", capabilities=dc_replace(TORCH_CAPS, modes=("colocated",)))
    a, b = gpus("n1", 2)
    pd = Plan(MODEL, "disaggregated", (Stage(0, 4, (a,)),), (Stage(0, 4, (b,)),), kv_reserve_tokens=1024)
    payload = {**prepare_payload(tiny_plan([[a]]), "n1"), "plan": pd.to_dict(), "plan_id": pd.plan_id}
    ack = agent.handle(command("prepare_plan", payload))
    assert ack.status == "failed" and ack.result["reason"] == "unsupported"
    assert ack.detail == "; ".join(engine_refusals(pd, ["n1"], {"n1": agent.capabilities}))
    assert agent.booked() == {}


class _Fixed:
    """A leader's engine as far as apply_hints sees it, with a threshold fixed at start (vLLM's)."""

    def __init__(self, plan_id: str) -> None:
        self.plan_id = plan_id

    def stop(self) -> None:
        pass


class _Stepper(_Fixed):
    """... and one with a batch-token threshold per step (the torch host's)."""

    def __init__(self, plan_id: str) -> None:
        super().__init__(plan_id)
        self.tokens: list[float | None] = []  # the scales it was given (None: back to its own)

    def set_batch_scale(self, scale: float | None) -> None:
        self.tokens.append(scale)


def test_apply_hints_sets_a_led_plan_s_threshold_ignores_stale_versions_and_lapses(make_agent: Any) -> None:
    from agents.node.daemon import PlanSlot

    now = [100.0]
    agent = make_agent(backend=False, clock=lambda: now[0])
    torch_like, vllm_like = _Stepper("p-torch"), _Fixed("p-vllm")
    agent.plans[("tiny", "p-torch")] = PlanSlot("tiny", "p-torch", "leader", {}, engine=torch_like)  # type: ignore[arg-type]
    agent.plans[("tiny", "p-vllm")] = PlanSlot("tiny", "p-vllm", "leader", {}, engine=vllm_like)  # type: ignore[arg-type]
    agent.plans[("tiny", "p-member")] = PlanSlot("tiny", "p-member", "member", {})

    def hint(pid: str, scale: float) -> dict[str, Any]:
        return {"plan_id": pid, "direction": "speed_up", "weight_multiplier": 0.8, "batch_scale": scale}

    payload = {"deployment": "tiny", "hints_version": 4, "ttl_s": 5.0,
               "plans": [hint("p-torch", 0.5), hint("p-vllm", 0.5), hint("p-member", 0.5)]}
    ack = agent.handle(command("apply_hints", payload))
    result = ok("apply_hints", ack)
    assert result == {"applied": True, "hints_version": 4, "plans": ["p-torch"], "unknown": ["p-vllm", "p-member"]}
    assert "p-vllm: its engine sets its batch threshold when it starts" in ack.detail
    assert torch_like.tokens == [0.5]
    stale = ok("apply_hints", agent.handle(command("apply_hints", {**payload, "hints_version": 3,
                                                                   "plans": [hint("p-torch", 2.0)]})))
    assert stale["applied"] is False and torch_like.tokens == [0.5]
    now[0] = 104.9
    agent._lapse_hints()
    assert torch_like.tokens == [0.5]  # still live
    now[0] = 105.0  # the global loop said nothing more: the engine's own threshold again
    agent._lapse_hints()
    assert torch_like.tokens == [0.5, None]
    agent._lapse_hints()
    assert torch_like.tokens == [0.5, None]  # once


def test_a_bad_hint_is_refused_naming_the_field(make_agent: Any) -> None:
    agent = make_agent(backend=False)
    ack = agent.handle(command("apply_hints", {"deployment": "tiny", "hints_version": 1, "ttl_s": -1, "plans": []}))
    assert ack.status == "failed" and "payload.ttl_s" in ack.detail and "payload.plans" in ack.detail
    assert agent.hints.versions == {}


class _Dying(_Fixed):
    """A leader's engine that dies for good when told (its host broke: no restart left)."""

    def __init__(self, plan_id: str) -> None:
        super().__init__(plan_id)
        self.failed = False
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


def test_a_plan_whose_engine_failed_for_good_is_given_up_and_its_report_no_longer_lists_it(make_agent: Any) -> None:
    from agents.node.daemon import PlanSlot
    from agents.protocol import Report

    agent = make_agent(backend=False)
    dying = _Dying("p-lead")
    agent.plans[("tiny", "p-lead")] = PlanSlot("tiny", "p-lead", "leader", {gpus("n1")[0]: 2**30}, engine=dying,  # type: ignore[arg-type]
                                               ready=True)
    agent.plans[("tiny", "p-member")] = PlanSlot("tiny", "p-member", "member", {gpus("n1")[1]: 2**30}, ready=True)
    sent: list[Report] = []
    agent.client.report = lambda body: sent.append(body) or body.seq
    agent.state.epoch = 1
    agent._give_up_failed()
    agent.report()
    assert sent[-1].plans == ("p-lead", "p-member") and not dying.stopped  # alive: kept and listed

    dying.failed = True
    agent._give_up_failed()
    assert dying.stopped and agent.booked() == {gpus("n1")[1]: 2**30} and agent.state.dirty
    agent.report()
    assert sent[-1].plans == ("p-member",)  # the controller replaces what is not listed
    release = ok("release_plan", agent.handle(command("release_plan", {"plan_id": "p-lead", "deployment": "tiny",
                                                                       "drain_timeout_s": 0})))
    assert release["freed_bytes"] == 0 and release["noop"] is True  # its undo, later: nothing left to do


def test_a_torch_plan_whose_worker_dies_is_given_up(make_agent: Any) -> None:
    import os
    import signal
    import time

    agent = make_agent("n1")
    plan = tiny_plan([gpus("n1", 1)])
    ok("prepare_plan", agent.handle(command("prepare_plan", prepare_payload(plan, "n1"))))
    slot = agent.plans[("tiny", plan.plan_id)]
    assert slot.engine is not None and not slot.engine.failed
    host = slot.engine.host  # type: ignore[attr-defined]
    os.kill(host.engine.pids[0], signal.SIGKILL)
    stream = host.admit("doomed", [1, 2, 3], 8, None)  # the engine finds its worker gone on this step
    deadline = time.monotonic() + 60
    while not slot.engine.failed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slot.engine.failed and stream.end is not None and "error" in stream.end
    agent._give_up_failed()
    assert agent.running_plans() == () and agent.booked() == {}
