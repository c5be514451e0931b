"""The paged KV cache: fixed-size blocks, one block table per sequence.

Two halves, as in vLLM: `BlockAllocator` is bookkeeping only (which physical blocks a sequence
owns) and lives with the engine's scheduler, one per worker group; `PagedKVCache` is the tensor
storage inside each worker. All workers of a group hold the same number of blocks and use the
same block table for a sequence — worker w stores, in block b, its own layers and its own KV
heads of the positions the table maps to b. So one allocation decision serves every worker,
and a capacity error is raised before any worker is touched.
"""

from __future__ import annotations

import torch


class KVCacheFullError(RuntimeError):
    """Not enough free blocks; nothing was allocated."""

    def __init__(self, seq_id: str, needed_blocks: int, free_blocks: int, num_blocks: int) -> None:
        super().__init__(
            f"KV cache full: sequence {seq_id!r} needs {needed_blocks} more block(s), "
            f"{free_blocks} of {num_blocks} free; to fix: finish or drop sequences, or give the "
            "engine more KV blocks (num_kv_blocks)"
        )
        self.seq_id = seq_id
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks


class BlockAllocator:
    """Hands out physical block ids to sequences.

    Invariants: every block id in [0, num_blocks) is either on the free list or in exactly one
    block table; a table of a sequence with n tokens has exactly ceil(n / block_size) blocks once
    `ensure` returned; a failed `ensure` changes nothing.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks: must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Reversed so the first allocations get the low ids: deterministic and easy to read in tests.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def missing_blocks(self, seq_id: str, num_tokens: int) -> int:
        """How many more blocks `ensure(seq_id, num_tokens)` would take."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def can_ensure(self, seq_id: str, num_tokens: int) -> bool:
        return self.missing_blocks(seq_id, num_tokens) <= len(self._free)

    def ensure(self, seq_id: str, num_tokens: int) -> tuple[int, ...]:
        """Grow the sequence's table to hold `num_tokens` tokens; return the table."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens: must be >= 0, got {num_tokens}")
        missing = self.missing_blocks(seq_id, num_tokens)
        if missing > len(self._free):
            raise KVCacheFullError(seq_id, missing, len(self._free), self.num_blocks)
        table = self._tables.setdefault(seq_id, [])
        for _ in range(missing):
            table.append(self._free.pop())
        return tuple(table)

    def block_table(self, seq_id: str) -> tuple[int, ...]:
        if seq_id not in self._tables:
            raise KeyError(f"seq_id: {seq_id!r} holds no KV blocks")
        return tuple(self._tables[seq_id])

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def free(self, seq_id: str) -> int:
        """Return the sequence's blocks to the free list; idempotent (0 when it held none)."""
        table = self._tables.pop(seq_id, [])
        # Pushed in reverse so a sequence that is freed and re-allocated gets the same ids back.
        self._free.extend(reversed(table))
        return len(table)


class PagedKVCache:
    """One worker's K and V: [layers, blocks, block_size, kv_heads, head_dim] each."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def _flat(self, t: torch.Tensor, layer: int) -> torch.Tensor:
        return t[layer].view(-1, t.shape[-2], t.shape[-1])

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [n, kv_heads, head_dim] at flat slots [n] (block * block_size + offset)."""
        self._flat(self.k, layer)[slots] = k
        self._flat(self.v, layer)[slots] = v

    def gather(self, layer: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [length, kv_heads, head_dim] of positions 0..length-1 of one sequence."""
        n_blocks = -(-length // self.block_size)
        idx = block_table[:n_blocks]
        k = self.k[layer][idx].reshape(-1, self.k.shape[-2], self.k.shape[-1])[:length]
        v = self.v[layer][idx].reshape(-1, self.v.shape[-2], self.v.shape[-1])[:length]
        return k, v

    def gather_slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V at flat slots of any shape S -> [*S, kv_heads, head_dim] (batched decode attention)."""
        return self._flat(self.k, layer)[slots], self._flat(self.v, layer)[slots]

    def read_sequence(self, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [layers, length, kv_heads, head_dim] of one sequence, for export."""
        n_blocks = -(-length // self.block_size)
        idx = block_table[:n_blocks]
        shape = (self.k.shape[0], -1, self.k.shape[-2], self.k.shape[-1])
        return self.k[:, idx].reshape(shape)[:, :length], self.v[:, idx].reshape(shape)[:, :length]

    def write_sequence(self, block_table: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [layers, length, kv_heads, head_dim] of one sequence, for import."""
        length = k.shape[1]
        pos = torch.arange(length, device=self.k.device)
        slots = block_table[pos // self.block_size] * self.block_size + pos % self.block_size
        for layer in range(self.k.shape[0]):
            self.write(layer, slots, k[layer], v[layer])
