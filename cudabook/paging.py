"""The host side of a paged KV cache: which blocks of the pool each request owns.

    from cudabook.paging import BlockAllocator, PagedTable
    table = PagedTable(BlockAllocator(num_blocks=1024, block_size=16), max_requests=32,
                       max_blocks=64)
    slot = table.admit(prompt_len=100)     # a free row; ceil(100 / 16) = 7 blocks for the prompt
    table.grow(slot)                       # room for one more token (a new block every 16)
    table.block_table, table.seq_lens      # int32 arrays for the kernels (copy them to the GPU)
    table.retire(slot)                     # the request's blocks go back to the pool

The pool itself lives on the GPU (``kernels/paged_attention.cu``: (NB, Hkv, BS, D) per layer for
K and for V); this module only decides who owns which block. Blocks are handed out from a free
list, so a request's blocks need not be contiguous and a retired request's blocks serve the next
one at once: memory is reserved per block of 16 tokens actually used, not per longest possible
sequence, which is what lets continuous batching keep more requests in flight than a static
batch padded to its longest member. Errors are raised before anything changes: a request that
does not fit, a slot that is not in use.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PoolExhausted", "BlockAllocator", "PagedTable"]


class PoolExhausted(RuntimeError):
    """Not enough free blocks (or free request slots) for what was asked; nothing was changed."""


class BlockAllocator:
    """A free list over ``num_blocks`` blocks of ``block_size`` token positions each."""

    def __init__(self, num_blocks: int, block_size: int):
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self._free = list(range(self.num_blocks - 1, -1, -1))   # pop() hands out 0, 1, 2, ...
        self._used = np.zeros(self.num_blocks, bool)

    @property
    def free(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` positions."""
        return -(-int(tokens) // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """``n`` free blocks (PoolExhausted, and nothing taken, if there are fewer)."""
        if n > len(self._free):
            raise PoolExhausted(f"{n} blocks asked, {len(self._free)} of {self.num_blocks} free")
        out = [self._free.pop() for _ in range(n)]
        self._used[out] = True
        return out

    def release(self, blocks) -> None:
        """Give blocks back; ValueError for a block that is not allocated (a double free)."""
        blocks = [int(b) for b in blocks]
        bad = [b for b in blocks if not 0 <= b < self.num_blocks or not self._used[b]]
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(f"release: blocks {bad or blocks} are not allocated (double free?)")
        self._used[blocks] = False
        self._free.extend(reversed(blocks))


class PagedTable:
    """The block table of up to ``max_requests`` requests, ``max_blocks`` blocks each, over one
    allocator: ``block_table`` (max_requests, max_blocks) int32 (-1 where no block is) and
    ``seq_lens`` (max_requests,) int32, the layout the kernels read."""

    def __init__(self, allocator: BlockAllocator, max_requests: int, max_blocks: int):
        if max_requests < 1 or max_blocks < 1:
            raise ValueError(f"max_requests and max_blocks must be positive, got {max_requests}, "
                             f"{max_blocks}")
        self.alloc = allocator
        self.max_requests, self.max_blocks = int(max_requests), int(max_blocks)
        self.block_table = np.full((self.max_requests, self.max_blocks), -1, np.int32)
        self.seq_lens = np.zeros(self.max_requests, np.int32)
        self.in_use = np.zeros(self.max_requests, bool)

    @property
    def capacity(self) -> int:
        """Most tokens one request can hold (max_blocks whole blocks)."""
        return self.max_blocks * self.alloc.block_size

    def fits(self, tokens: int) -> bool:
        """Whether a new request of ``tokens`` positions could be admitted now."""
        return (not self.in_use.all() and 1 <= tokens <= self.capacity
                and self.alloc.blocks_for(tokens) <= self.alloc.free)

    def admit(self, prompt_len: int) -> int:
        """A free slot holding ``prompt_len`` positions (the prompt, before its first decode
        step); ValueError for an empty or too long prompt, PoolExhausted when it does not fit."""
        if prompt_len < 1:
            raise ValueError(f"an empty prompt (length {prompt_len}) has nothing to attend to")
        if prompt_len > self.capacity:
            raise ValueError(f"a prompt of {prompt_len} tokens is longer than the cache holds per "
                             f"request ({self.max_blocks} blocks of {self.alloc.block_size} = "
                             f"{self.capacity})")
        free_slots = np.flatnonzero(~self.in_use)
        if free_slots.size == 0:
            raise PoolExhausted(f"all {self.max_requests} request slots are in use")
        blocks = self.alloc.allocate(self.alloc.blocks_for(prompt_len))
        slot = int(free_slots[0])
        self.block_table[slot] = -1
        self.block_table[slot, :len(blocks)] = blocks
        self.seq_lens[slot] = prompt_len
        self.in_use[slot] = True
        return slot

    def grow(self, slot: int) -> int:
        """Make room for one more token of request ``slot`` (a new block when the last one is
        full) and count it: returns the new token's position."""
        self._need(slot)
        t = int(self.seq_lens[slot])
        if t >= self.capacity:
            raise ValueError(f"request in slot {slot} is full ({self.capacity} tokens)")
        if t % self.alloc.block_size == 0:
            self.block_table[slot, t // self.alloc.block_size] = self.alloc.allocate(1)[0]
        self.seq_lens[slot] = t + 1
        return t

    def retire(self, slot: int) -> None:
        """Request ``slot`` is done: its blocks return to the pool, the slot is free."""
        self._need(slot)
        row = self.block_table[slot]
        self.alloc.release(row[row >= 0])
        self.block_table[slot] = -1
        self.seq_lens[slot] = 0
        self.in_use[slot] = False

    def positions(self, slot: int) -> np.ndarray:
        """(physical block, offset) of each position of request ``slot``, in order."""
        self._need(slot)
        t = np.arange(int(self.seq_lens[slot]))
        bs = self.alloc.block_size
        return np.stack([self.block_table[slot, t // bs], t % bs], axis=1)

    def _need(self, slot: int) -> None:
        if not 0 <= slot < self.max_requests or not self.in_use[slot]:
            raise ValueError(f"slot {slot} holds no request")
