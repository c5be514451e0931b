"""The node's host-memory weight cache: hits and misses, LRU by bytes, leases that keep an entry,
a restart that adopts what is there; and prepare_plan loading from it, saying which source it used."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from agents.node.plans import ModelStore, TorchBackend
from agents.node.weightcache import HostWeightCache, folder_bytes
from agents.protocol import check_result
from tests.agents.node.conftest import MODEL, command, free_port, gpus, prepare_payload, tiny_plan


def _model(root: Path, name: str, size: int) -> tuple[Path, str]:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(bytes([len(name)]) * size)
    return folder, name[0] * 64


def test_a_miss_copies_the_folder_in_and_the_next_fetch_reads_it_from_ram(tmp_path: Path) -> None:
    cache = HostWeightCache(tmp_path / "cache", 10_000)
    folder, digest = _model(tmp_path, "a", 3000)
    with cache.use(folder, digest) as got:
        assert got.source == "disk" and got.folder == tmp_path / "cache" / digest
        assert (got.folder / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    with cache.use(folder, digest) as again:
        assert again.source == "host_cache" and again.folder == got.folder and again.copy_s == 0.0
    assert (cache.hits, cache.misses) == (1, 1)


def test_the_least_recently_used_entry_goes_first_and_a_leased_one_never(tmp_path: Path) -> None:
    cache = HostWeightCache(tmp_path / "cache", 7_000)
    a, b, c = (_model(tmp_path, n, 3000) for n in ("a", "b", "c"))
    held = cache.fetch(*a)  # a running plan holds a: its lease stays
    with cache.use(*b):
        pass
    with cache.use(*c):  # 9,000 bytes wanted: b (unleased) goes, a stays
        pass
    assert cache.holds(a[1]) and not cache.holds(b[1]) and cache.holds(c[1])
    assert not (tmp_path / "cache" / b[1]).exists() and cache.used_bytes == 2 * folder_bytes(a[0])
    cache.release(held.folder.name)
    with cache.use(*b):  # now a is the least recently used and free to go
        pass
    assert not cache.holds(a[1]) and cache.holds(b[1]) and cache.holds(c[1])


def test_a_folder_that_cannot_fit_loads_from_the_disk_folder_itself(tmp_path: Path) -> None:
    cache = HostWeightCache(tmp_path / "cache", 4_000)
    big = _model(tmp_path, "big", 5000)
    with cache.use(*big) as got:
        assert got.source == "disk" and got.folder == big[0]
    a = _model(tmp_path, "a", 3000)
    held = cache.fetch(*a)
    b = _model(tmp_path, "b", 3000)
    with cache.use(*b) as got:  # a is leased: no room for b
        assert got.folder == b[0] and got.source == "disk"
    assert cache.holds(a[1]) and not cache.holds(b[1])
    cache.release(held.folder.name)


def test_a_restarted_agent_adopts_the_entries_and_removes_half_copies(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    first = HostWeightCache(root, 10_000)
    a = _model(tmp_path, "a", 2000)
    with first.use(*a):
        pass
    (root / ".partial-zzz").mkdir()
    second = HostWeightCache(root, 10_000)
    assert second.holds(a[1]) and not (root / ".partial-zzz").exists()
    with second.use(*a) as got:
        assert got.source == "host_cache"


def test_two_plans_missing_the_same_model_at_once_copy_it_once(tmp_path: Path) -> None:
    cache = HostWeightCache(tmp_path / "cache", 10**9)
    a = _model(tmp_path, "a", 20_000_000)
    got: list[Any] = []
    threads = [threading.Thread(target=lambda: got.append(cache.fetch(*a))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(g.source for g in got) == ["disk", "host_cache", "host_cache", "host_cache"]
    assert cache.misses == 1 and {g.folder for g in got} == {tmp_path / "cache" / a[1]}


def test_a_bad_capacity_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostWeightCache(tmp_path, -1)


def test_prepare_plan_loads_from_the_cache_the_second_time_and_its_ack_says_so(
        tmp_path: Path, models_dir: Path, make_agent: Any) -> None:
    from agents.node.daemon import NodeAgent
    from agents.node.gpuspec import SpecProbe

    cache = HostWeightCache(tmp_path / "cache", 1 << 30)
    addr = f"127.0.0.1:{free_port()}"
    backend = TorchBackend(ModelStore(models_dir, cache), addr, num_kv_blocks=64)
    agent = NodeAgent(controller="http://127.0.0.1:9", join_token="fpj_unused", probe=SpecProbe("2xA100-80G", "n1"),
                      backend=backend, backend_name="torch", node_id="n1", data_addr=addr)
    try:
        sources = []
        slos = [None, {"ttft_ms": 250, "tpot_ms": 40}]  # the second carries its deployment's objectives
        for gpu, slo in zip(gpus("n1", 2), slos, strict=True):  # two plans of the model, one after the other
            plan = tiny_plan([[gpu]])
            payload = {**prepare_payload(plan, "n1"), "model_version": {"id": 1, "version": "1", "tokenizer": "t",
                                                                        "warmup_tokens": 3, "max_context": 100}}
            if slo is not None:
                payload["slo"] = slo
            ack = agent.handle(command("prepare_plan", payload))
            assert ack.status == "ok", ack.detail
            result = check_result("prepare_plan", ack.result)
            sources.append(result["weights_source"])
            assert result["weights_bytes"] > 0
            host = agent.plans[("tiny", plan.plan_id)].engine.host  # type: ignore[union-attr]
            assert Path(host.model_dir).parent == tmp_path / "cache", "the engine loaded the cache's copy"
            assert host.engine.stats.tokens_generated == 3, "the warm-up ran its tokens before serving"
            assert host.slo_ms == (None if slo is None else (250.0, 40.0)), "its reports count misses against it"
            # the registry's max_context for the version binds below the model's own positions
            with pytest.raises(ValueError, match="the registered max_context 100"):
                host.admit(f"long-{gpu}", [1] * 90, 20, None)
            host.admit(f"fits-{gpu}", [1] * 90, 10, None)
        assert sources == ["disk", "host_cache"]
        assert cache.holds(backend.models.resolve(MODEL, None)[1])
        for key in list(agent.plans):
            release = command("release_plan", {"plan_id": key[1], "deployment": "tiny", "drain_timeout_s": 0})
            assert agent.handle(release).status == "ok"
        assert not cache._leases, "a stopped plan lets go of its entry"
    finally:
        agent.close()


def test_a_warm_up_the_engine_cannot_hold_fails_the_prepare_and_books_nothing(make_agent: Any) -> None:
    agent = make_agent()
    payload = {**prepare_payload(tiny_plan([gpus("n1", 1)]), "n1"),
               "model_version": {"id": 1, "version": "1", "tokenizer": "t", "warmup_tokens": 10**6}}
    ack = agent.handle(command("prepare_plan", payload))
    assert ack.status == "failed" and "max_new_tokens" in ack.detail
    assert agent.booked() == {} and not agent.plans
