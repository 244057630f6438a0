"""Continuous batching over a paged KV cache: which requests run in each decode step.

    from cudabook.batching import Request, ContinuousBatcher, static_batches
    cb_ = ContinuousBatcher(table)                 # a cudabook.paging.PagedTable
    cb_.submit(Request("a", prompt=[5, 7, 9], max_new_tokens=20))
    while not cb_.idle:
        for slot, req in cb_.admit():              # new this step: run their prompts (prefill)
            ...; cb_.commit(slot, first_token)
        slots = cb_.decoding()                     # one decode step for all of these at once
        ...; cb_.commit(slot, token) for each      # a request leaves as soon as it is done
    cb_.results                                    # {request id: generated tokens}

A static batch runs B requests from the first step to the last token of the longest, every
step paying for all B rows (the finished ones are padding), and reserves cache for B times the
longest sequence. Continuous batching retires a request the step it finishes and admits the next
waiting one into its slot and its blocks, so the batch stays full of work. Admission reserves the
blocks a request can ever need (prompt + max_new_tokens), so a running request never waits for
memory and nothing has to be evicted; the table hands the blocks out only as positions are used.
``static_batches`` gives the padded schedule of the same requests, the baseline.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .paging import PagedTable

__all__ = ["Request", "ContinuousBatcher", "static_batches"]


@dataclass
class Request:
    """A generation request: its prompt (token ids) and how many tokens it may generate."""
    id: object
    prompt: list
    max_new_tokens: int
    eos: int | None = None                 # stop early on this token, when given
    out: list = field(default_factory=list)

    def __post_init__(self):
        self.prompt = [int(t) for t in self.prompt]
        if not self.prompt:
            raise ValueError(f"request {self.id!r}: an empty prompt")
        if isinstance(self.max_new_tokens, bool) or int(self.max_new_tokens) < 1:
            raise ValueError(f"request {self.id!r}: max_new_tokens must be >= 1, got "
                             f"{self.max_new_tokens!r}")
        self.max_new_tokens = int(self.max_new_tokens)

    @property
    def total(self) -> int:
        """The most positions it can occupy: the prompt and every generated token but the
        last (which is never fed back)."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def done(self) -> bool:
        return len(self.out) >= self.max_new_tokens or \
            (self.eos is not None and bool(self.out) and self.out[-1] == self.eos)


class ContinuousBatcher:
    """First come, first served admission into the free slots of ``table``, with every
    request's worst-case blocks reserved at admission."""

    def __init__(self, table: PagedTable):
        self.table = table
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.results: dict = {}
        self.reserved: dict[int, int] = {}            # slot -> blocks promised, not yet taken
        self.steps = 0                                # decode steps taken (decoding() calls)

    def submit(self, req: Request) -> None:
        if req.total > self.table.capacity:
            raise ValueError(f"request {req.id!r}: {req.total} positions, more than a request "
                             f"can hold ({self.table.capacity})")
        if req.id in self.results or any(r.id == req.id for r in self.waiting) or \
                any(r.id == req.id for r in self.running.values()):
            raise ValueError(f"request id {req.id!r} submitted twice")
        self.waiting.append(req)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _promised(self) -> int:
        return sum(self.reserved.values())

    def admit(self) -> list[tuple[int, Request]]:
        """Admit waiting requests, in order, while a slot and their worst-case blocks are free;
        each gets its prompt's blocks now. Returns the admitted (slot, request) pairs: the caller
        runs their prompts (prefill) and commits each one's first token."""
        out = []
        alloc = self.table.alloc
        while self.waiting:
            req = self.waiting[0]
            need = alloc.blocks_for(req.total)
            if self.table.in_use.all() or need > alloc.free - self._promised():
                break                                 # first come, first served: no overtaking
            self.waiting.popleft()
            slot = self.table.admit(len(req.prompt))
            self.reserved[slot] = need - alloc.blocks_for(len(req.prompt))
            self.running[slot] = req
            out.append((slot, req))
        return out

    def decoding(self) -> list[int]:
        """The slots of this decode step: every running request that has its first token (its
        last token is the input); each gets room for that token's position first."""
        slots = [s for s, r in sorted(self.running.items()) if r.out]
        for s in slots:
            before = self.table.alloc.free
            self.table.grow(s)
            self.reserved[s] -= before - self.table.alloc.free     # a promised block taken
        self.steps += 1
        return slots

    def commit(self, slot: int, token: int) -> None:
        """The token the model produced for ``slot``; a finished request leaves at once, its
        blocks and its unused promise back to the pool."""
        req = self.running[slot]
        req.out.append(int(token))
        if req.done:
            self.results[req.id] = list(req.out)
            del self.running[slot]
            del self.reserved[slot]
            self.table.retire(slot)


def static_batches(requests: list[Request], batch: int) -> list[dict]:
    """The padded baseline: requests in arrival order, ``batch`` at a time; each batch runs
    until its longest request is done, every step computing all its rows. Returns, per batch,
    its request ids, decode steps and the rows computed (steps x rows, padding included)."""
    out = []
    for i in range(0, len(requests), batch):
        group = requests[i:i + batch]
        steps = max(r.max_new_tokens for r in group) - 1         # the first token: prefill
        out.append({"ids": [r.id for r in group], "steps": steps, "rows": steps * len(group),
                    "useful_rows": sum(r.max_new_tokens - 1 for r in group),
                    "max_positions": max(r.total for r in group)})
    return out
