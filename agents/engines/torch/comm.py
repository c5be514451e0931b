"""Device and collective-backend selection, and the collectives a stage worker uses.

Rules (one worker group = one torch.distributed world):
- device "cpu": gloo.
- device "cuda": the engine hands out its GPUs (`gpus`, default every visible one) to its
  workers round-robin, prefill group first; nccl when every rank of a group got a GPU of its
  own. NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), so a
  group with more ranks than distinct GPUs falls back to gloo, staging tensors through host
  memory. `backend=` forces a choice (and a forced nccl that cannot work is rejected here, with
  the reason, instead of failing inside NCCL).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = ("auto", "gloo", "nccl")


def check_device(device: str) -> str:
    """Normalise `device` ("cpu" or "cuda") or say why it cannot be used here."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but torch.cuda.is_available() is False on this machine")
    return device


def select_backend(device: str, group_size: int, backend: str = "auto", num_gpus: int | None = None) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {list(BACKENDS)}, got {backend!r}")
    if device == "cpu":
        if backend == "nccl":
            raise ValueError("backend: nccl needs device 'cuda'")
        return "gloo"
    gpus = torch.cuda.device_count() if num_gpus is None else num_gpus
    if backend == "nccl" and group_size > gpus:
        raise ValueError(
            f"backend: nccl needs one GPU per rank; the group has {group_size} ranks and {gpus} visible GPU(s) "
            "(use backend 'gloo' or 'auto', or make more GPUs visible)"
        )
    if backend == "auto":
        return "nccl" if group_size <= gpus else "gloo"
    return backend


def check_gpus(device: str, gpus: Sequence[int] | None) -> tuple[int, ...]:
    """The GPU indices an engine may use: `gpus` checked, or every visible one; () on the CPU."""
    if device == "cpu":
        if gpus:
            raise ValueError("gpus: only meaningful with device 'cuda'")
        return ()
    visible = torch.cuda.device_count()
    if gpus is None:
        return tuple(range(visible))
    out = tuple(gpus)
    if not out:
        raise ValueError("gpus: must name at least one GPU")
    for i, g in enumerate(out):
        if not isinstance(g, int) or isinstance(g, bool) or not 0 <= g < visible:
            raise ValueError(f"gpus[{i}]: must be a visible GPU index in [0, {visible}), got {g!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"gpus: lists a GPU twice: {list(out)}")
    return out


def worker_device(device: str, gpu: int | None) -> torch.device:
    if device == "cpu" or gpu is None:
        return torch.device("cpu")
    return torch.device("cuda", gpu)


@dataclass
class StageComm:
    """The collectives of one worker: all-reduce inside its TP group, send/recv between stages."""

    backend: str
    device: torch.device
    tp_group: dist.ProcessGroup | None  # None when the stage has tp == 1
    prev_ranks: tuple[int, ...]  # global rank this worker receives its hidden state from (0 or 1 entry)
    next_ranks: tuple[int, ...]  # global ranks this worker sends its hidden state to

    @property
    def _stage_through_host(self) -> bool:
        # gloo moves CPU tensors only (its CUDA paths are partial); copy through host memory.
        return self.backend == "gloo" and self.device.type == "cuda"

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return t
        if self._stage_through_host:
            host = t.cpu()
            dist.all_reduce(host, group=self.tp_group)
            return host.to(self.device)
        dist.all_reduce(t, group=self.tp_group)
        return t

    def send_next(self, t: torch.Tensor) -> None:
        payload = t.cpu() if self._stage_through_host else t.contiguous()
        for dst in self.next_ranks:
            dist.send(payload, dst=dst)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        (src,) = self.prev_ranks
        on = torch.device("cpu") if self._stage_through_host else self.device
        buf = torch.empty(shape, dtype=dtype, device=on)
        dist.recv(buf, src=src)
        return buf.to(self.device)
