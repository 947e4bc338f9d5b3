"""Which slots hold tokens, on the device: what attention may see, and the token in each slot.

The ledgers (ledger.py) keep the cache's bookkeeping in Python ints on the host. The
device needs part of it as tensors: attention masks come from which slots hold
tokens, the repetition penalty from which tokens those are, and a decode step reads
its slots and angles from `scalars`, so that one compiled graph serves every step.
"""

from __future__ import annotations

import torch

from streamchat.cache.ledger import Run, SlidingLedger, StreamLedger

# What a decode step reads from `Occupancy.scalars`, written by the host before the step.
POSITION, SINK_SHIFT, WRITE, FREE, SLIDING_WRITE, SLIDING_FREE = range(6)


class Occupancy:
    """`held` [slots] and `token_ids` [slots] of the sink layers' layout, `sliding_held` of the sliding ring."""

    def __init__(self, slots: int, sliding_slots: int, device: torch.device) -> None:
        self.held = torch.zeros(slots, dtype=torch.bool, device=device)
        self.sliding_held = torch.zeros(sliding_slots, dtype=torch.bool, device=device)
        self.token_ids = torch.zeros(slots, dtype=torch.long, device=device)
        self.scalars = torch.zeros(6, dtype=torch.long, device=device)
        self.device = device

    def tensors(self) -> list[torch.Tensor]:
        return [self.held, self.sliding_held, self.token_ids, self.scalars]

    def sync(self, ledger: StreamLedger, sliding: SlidingLedger | None) -> None:
        """Mark the slots the ledgers say are held, from scratch (eager, between steps)."""
        self.held.zero_()
        self.held[: ledger.sinks_held] = True
        for start, stop in ledger.ring.held():
            self.held[ledger.sinks + start : ledger.sinks + stop] = True
        if sliding is not None:
            self.sliding_held.zero_()
            for start, stop in sliding.ring.held():
                self.sliding_held[start:stop] = True

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """The tokens token_ids [n] now sit in slots [n]."""
        self.token_ids[slots] = token_ids.to(self.device)

    def send(self, values: list[int]) -> None:
        """A decode step's slots and angles, from the host (without waiting for the device)."""
        self.scalars.copy_(torch.tensor(values), non_blocking=True)

    def take_decode_step(self, token: torch.Tensor) -> None:
        """On the device, inside the step: the freed slots leave, token [1, 1] takes the written one."""
        scalars = self.scalars
        self.held.index_fill_(0, self.slot(FREE), False)
        self.held.index_fill_(0, self.slot(WRITE), True)
        self.token_ids.index_copy_(0, self.slot(WRITE), token.reshape(1))
        if self.sliding_held.numel():
            self.sliding_held.index_fill_(0, scalars[SLIDING_FREE : SLIDING_FREE + 1], False)
            self.sliding_held.index_fill_(0, self.slot(SLIDING_WRITE), True)

    def slot(self, which: int) -> torch.Tensor:
        """One of the scalars as a one-element index tensor."""
        return self.scalars[which : which + 1]


def slot_index(runs: list[Run] | tuple[Run, ...], device: torch.device) -> torch.Tensor:
    """The slots of `runs`, in order, as an index tensor."""
    return torch.tensor([slot for start, stop in runs for slot in range(start, stop)], device=device)
