"""Shared fixtures for the torch engine tests: one tiny model, one pool of live engines.

Worker processes are the expensive part, so each layout's engine is started once per session
(lazily, on first use) and shared; a test that leaves sequences behind gets them dropped, and a
test that breaks an engine gets a fresh one next time. At the end every worker must be gone.

FLEXPIPE_TORCH_DEVICE=cuda runs the same tests on a GPU machine (nccl where each rank of a group
has its own GPU, gloo staged through host memory otherwise).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from agents.engines.torch.engine import TorchEngine
from agents.engines.torch.layout import Layout, StageSpec
from agents.engines.torch.model import ModelConfig, load_full_weights, reference_generate
from agents.engines.torch.sampling import SamplingParams
from agents.engines.torch.weights import make_tiny_llama

DEVICE = os.environ.get("FLEXPIPE_TORCH_DEVICE", "cpu")
NUM_LAYERS = 4

LAYOUTS: dict[str, Layout] = {
    "tp1": Layout.pipeline(NUM_LAYERS),
    "tp2": Layout.pipeline(NUM_LAYERS, tp=2),
    "pp2": Layout.pipeline(NUM_LAYERS, pp=2),  # TP1 x PP2
    "tp2pp2": Layout.pipeline(NUM_LAYERS, pp=2, tp=2),
    "tp4": Layout.pipeline(NUM_LAYERS, tp=4),  # more ranks than KV heads: each KV head on two ranks
    # Uneven stages with different TP: the hand-off maps 1 sender to 2 receivers.
    "mixed": Layout(stages=(StageSpec(0, 1, 1), StageSpec(1, 4, 2))),
    "disagg": Layout.disaggregated(NUM_LAYERS, prefill_tp=1, decode_tp=2),
}


@dataclass(frozen=True)
class TinyModel:
    path: Path
    sha256: str
    cfg: ModelConfig
    weights: dict[str, torch.Tensor]
    _references: dict[tuple[tuple[int, ...], SamplingParams], list[int]] = field(default_factory=dict, repr=False)

    def reference(self, prompt: Sequence[int], n: int, sampling: SamplingParams | None = None) -> list[int]:
        """What the reference forward pass generates. It recomputes the whole sequence per token
        (seconds for a few hundred), and several tests ask for the same prompt, so each (prompt,
        sampling) is generated once per session: generation is sequential - the generator is
        drawn once per token - so the first k tokens of a longer run are the k-token run."""
        params = sampling or SamplingParams()
        key = (tuple(prompt), params)
        have = self._references.get(key, [])
        if len(have) < n and not (have and have[-1] in self.cfg.eos_token_ids and not params.ignore_eos):
            have = reference_generate(self.weights, self.cfg, prompt, n, params)
            self._references[key] = have
        return list(have[:n])


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    path = tmp_path_factory.mktemp("tiny-llama")
    sha = make_tiny_llama(path)
    return TinyModel(path, sha, ModelConfig.from_dir(path), load_full_weights(path))


class EnginePool:
    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._engines: dict[str, TorchEngine] = {}
        self.all_pids: list[int] = []

    def get(self, name: str) -> TorchEngine:
        engine = self._engines.get(name)
        if engine is None or not all(g.alive for g in engine._groups.values()):
            engine = TorchEngine(self.model_dir, LAYOUTS[name], device=DEVICE, timeout_s=60)
            self._engines[name] = engine
            self.all_pids += engine.pids
        return engine

    def tidy(self) -> None:
        for engine in self._engines.values():
            if all(g.alive for g in engine._groups.values()):
                for seq_id in engine.sequence_ids():
                    engine.drop(seq_id)
                engine.max_tokens_per_step = 256

    def close(self) -> None:
        for engine in self._engines.values():
            engine.shutdown()


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (ours are reaped by multiprocessing)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1][:1] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="session")
def engine_pool(tiny_model: TinyModel) -> Iterator[EnginePool]:
    pool = EnginePool(tiny_model.path)
    yield pool
    pool.close()
    leaked = [pid for pid in pool.all_pids if pid_alive(pid)]
    assert not leaked, f"worker processes left running: {leaked}"


@pytest.fixture
def engines(engine_pool: EnginePool) -> Iterator[EnginePool]:
    yield engine_pool
    engine_pool.tidy()


def run_to_end(
    engine: TorchEngine, out: dict[str, list[int]] | None = None, max_steps: int = 1000
) -> dict[str, list[int]]:
    """Step until every sequence finished; tokens per sequence, in order."""
    out = {} if out is None else out
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return out
        for o in engine.step():
            out.setdefault(o.seq_id, []).append(o.token_id)
    raise AssertionError(f"still unfinished after {max_steps} steps: {engine.sequence_ids()}")


GREEDY = SamplingParams(ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
SEEDED_TOPK = SamplingParams(temperature=1.3, top_k=20, seed=99, ignore_eos=True)
