"""The stage worker: one process per (stage, TP rank) of a worker group.

A worker joins its group's torch.distributed world, loads only its slice of the weights, owns
its part of the paged KV cache, and then serves commands from the engine over a pipe until told
to stop (or until the pipe closes because the engine's process died). Hidden states between
stages and TP all-reduces go over torch.distributed; only small control messages, sampled
token ids and exported/imported KV go over the pipe.

Messages are (command, payload) tuples; every command gets exactly one reply, ("ok", result) or
("error", traceback text). After an error inside a step the group is not trusted any more
(its peers may be stuck in a collective): the engine tears the group down.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from agents.engines.torch.comm import StageComm, worker_device
from agents.engines.torch.kvcache import PagedKVCache
from agents.engines.torch.layout import StageSpec
from agents.engines.torch.model import ModelConfig, SeqChunk, StageModel, load_stage_weights, tp_shard
from agents.engines.torch.sampling import SamplingParams, make_generator, sample


@dataclass(frozen=True)
class WorkerSpec:
    model_dir: str
    stages: tuple[StageSpec, ...]  # the whole group's pipeline, so every rank builds the same groups
    stage_index: int
    tp_rank: int
    store_host: str
    store_port: int
    device: str  # "cpu" | "cuda"
    rank_gpus: tuple[int, ...]  # the GPU of each rank of the group (empty on the CPU)
    backend: str  # resolved: "gloo" | "nccl"
    num_blocks: int
    block_size: int
    timeout_s: float
    num_threads: int

    @property
    def world_size(self) -> int:
        return sum(s.tp for s in self.stages)

    def rank_of(self, stage_index: int, tp_rank: int) -> int:
        return sum(s.tp for s in self.stages[:stage_index]) + tp_rank

    @property
    def rank(self) -> int:
        return self.rank_of(self.stage_index, self.tp_rank)


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[SeqChunk, ...]
    token_ids: tuple[int, ...]  # the chunks' new tokens, concatenated (read by the first stage)
    sampling: dict[str, tuple[SamplingParams, int]]  # seq -> (params, draws so far), sampled chunks only
    forget: tuple[str, ...] = field(default=())  # sequences gone from the engine: drop their generators


@dataclass
class _GenSlot:
    params: SamplingParams
    draws: int
    gen: torch.Generator


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.device = worker_device(spec.device, spec.rank_gpus[spec.rank] if spec.rank_gpus else None)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.cfg = ModelConfig.from_dir(spec.model_dir)
        timeout = timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore(  # type: ignore[attr-defined]
            spec.store_host, spec.store_port, None, is_master=False, timeout=timeout
        )
        dist.init_process_group(
            spec.backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout
        )
        # new_group is collective over the whole world: every rank creates every TP group, in
        # stage order, and keeps its own.
        tp_group = None
        for i, s in enumerate(spec.stages):
            if s.tp > 1:
                group = dist.new_group([spec.rank_of(i, r) for r in range(s.tp)])
                if i == spec.stage_index:
                    tp_group = group
        stage = spec.stages[spec.stage_index]
        prev_ranks: tuple[int, ...] = ()
        if spec.stage_index > 0:
            prev = spec.stages[spec.stage_index - 1]
            prev_ranks = (spec.rank_of(spec.stage_index - 1, spec.tp_rank % prev.tp),)
        next_ranks: tuple[int, ...] = ()
        if spec.stage_index + 1 < len(spec.stages):
            nxt = spec.stages[spec.stage_index + 1]
            next_ranks = tuple(
                spec.rank_of(spec.stage_index + 1, u) for u in range(nxt.tp) if u % stage.tp == spec.tp_rank
            )
        self.comm = StageComm(spec.backend, self.device, tp_group, prev_ranks, next_ranks)
        self.shard = tp_shard(self.cfg, stage.tp, spec.tp_rank)
        self.is_first = spec.stage_index == 0
        self.is_last = spec.stage_index == len(spec.stages) - 1
        self.samples = self.is_last and spec.tp_rank == 0
        weights = load_stage_weights(
            spec.model_dir,
            self.cfg,
            stage.layer_start,
            stage.layer_end,
            self.shard,
            with_embed=self.is_first,
            with_head=self.is_last,
            device=self.device,
        )
        self.model = StageModel(self.cfg, weights, self.comm.all_reduce)
        self.cache = PagedKVCache(
            stage.layer_end - stage.layer_start,
            spec.num_blocks,
            spec.block_size,
            self.shard.num_kv_heads,
            self.cfg.head_dim,
            device=self.device,
        )
        self.gens: dict[str, _GenSlot] = {}

    def info(self) -> dict[str, object]:
        return {
            "pid": os.getpid(),
            "rank": self.spec.rank,
            "device": str(self.device),
            "backend": self.spec.backend,
            "kv_cache_bytes": self.cache.nbytes,
        }

    # -- commands --------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> dict[str, int] | None:
        for seq_id in plan.forget:
            self.gens.pop(seq_id, None)
        if not plan.chunks:
            return {} if self.samples else None
        n_tok = sum(c.num_tokens for c in plan.chunks)
        if self.is_first:
            ids = torch.tensor(plan.token_ids, dtype=torch.long, device=self.device)
            hidden = self.model.embed(ids)
        else:
            hidden = self.comm.recv_prev((n_tok, self.cfg.hidden_size), torch.float32)
        hidden = self.model.forward(hidden, plan.chunks, self.cache)
        if not self.is_last:
            self.comm.send_next(hidden)
            return None
        if not self.samples:
            return None
        rows, sampled = [], []
        end = 0
        for c in plan.chunks:
            end += c.num_tokens
            if c.sample:
                rows.append(end - 1)
                sampled.append(c.seq_id)
        if not rows:
            return {}
        logits = self.model.logits(hidden[torch.tensor(rows, device=self.device)]).cpu()
        out = {}
        for j, seq_id in enumerate(sampled):
            params, draws = plan.sampling[seq_id]
            out[seq_id] = sample(logits[j], params, self._generator(seq_id, params, draws))
        return out

    def _generator(self, seq_id: str, params: SamplingParams, draws: int) -> torch.Generator | None:
        """The sequence's generator positioned after `draws` draws (rebuilt when it is not)."""
        if params.greedy:
            return None
        slot = self.gens.get(seq_id)
        if slot is None or slot.params != params or slot.draws != draws:
            slot = _GenSlot(params, draws, make_generator(params, draws))
            self.gens[seq_id] = slot
        slot.draws += 1  # `sample` draws exactly once
        return slot.gen

    @torch.inference_mode()
    def export(self, block_table: tuple[int, ...], length: int) -> tuple[np.ndarray, np.ndarray]:
        table = torch.tensor(block_table, dtype=torch.long, device=self.device)
        k, v = self.cache.read_sequence(table, length)
        return k.cpu().numpy().copy(), v.cpu().numpy().copy()

    @torch.inference_mode()
    def import_(self, block_table: tuple[int, ...], k: np.ndarray, v: np.ndarray) -> None:
        table = torch.tensor(block_table, dtype=torch.long, device=self.device)
        self.cache.write_sequence(
            table, torch.from_numpy(k).to(self.device), torch.from_numpy(v).to(self.device)
        )


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Process entry point. Answers ("ready", info) or ("error", text) first, then serves commands."""
    torch.set_num_threads(spec.num_threads)
    try:
        worker = Worker(spec)
    except BaseException:  # noqa: BLE001 - any failure to start is reported, then the process ends
        conn.send(("error", traceback.format_exc()))
        conn.close()
        return
    conn.send(("ready", worker.info()))
    handlers: dict[str, Callable[[Any], object]] = {
        "step": worker.step,
        "export": lambda payload: worker.export(payload[0], payload[1]),
        "import": lambda payload: worker.import_(payload[0], payload[1], payload[2]),
    }
    try:
        while True:
            try:
                command, payload = conn.recv()
            except (EOFError, OSError):
                break  # the engine is gone: nothing left to serve
            if command == "shutdown":
                conn.send(("ok", None))
                break
            try:
                handler = handlers[command]
                conn.send(("ok", handler(payload)))
            except BaseException:  # noqa: BLE001 - the engine decides what a failed worker means
                conn.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()
