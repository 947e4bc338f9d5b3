"""Which token each slot of the sink layers holds, and its label: the cache's one record of its contents.

The ledger (ledger.py) says which slots hold tokens; the record says which tokens, and
who fed them: a label the feeder chooses and the cache never reads (a conversation's
transcript message index). Host ints, written as a pass assigns its slots, one entry a
token. The device keeps the same ids for the passes that read them there (masks.py: Occupancy);
the host's are what a view, an eviction's text and a saved state read, without waiting
for the device.

A decode pass feeds a device tensor, so the host may learn its token a pass late
(SinkCache.learn_token); until then its slot says UNREAD.

Only held slots mean anything. A pass writes free slots only and an eviction only moves
the ledger, so taking passes back (snapshots.py) needs the ledger alone, as the keys do;
the ledger also counts what was forgotten (`evicted`, `skipped`, `last_forgotten_label`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from streamchat.cache.ledger import NO_LABEL, Run, StreamLedger
from streamchat.errors import CacheStateError

# A decode pass's token id until the host reads it back.
UNREAD = -1


@dataclass(frozen=True)
class HeldTokens:
    """What the cache holds, in stream order (the sinks, then the window oldest first), and what it forgot."""

    sink_ids: tuple[int, ...]
    sink_labels: tuple[int, ...]
    window_ids: tuple[int, ...]
    window_labels: tuple[int, ...]
    forgotten: int  # tokens evicted or skipped
    last_forgotten_label: int  # the latest of them's label; NO_LABEL before any

    @property
    def token_ids(self) -> list[int]:
        """Every token the model sees, in the order it sees them."""
        return [*self.sink_ids, *self.window_ids]


class SlotRecord:
    """Per physical slot of the sink layers (sinks, then ring): the token id and the label last written there."""

    def __init__(self, token_ids: list[int], labels: list[int]) -> None:
        self.token_ids = token_ids
        self.labels = labels

    @classmethod
    def empty(cls, slots: int) -> SlotRecord:
        return cls([UNREAD] * slots, [NO_LABEL] * slots)

    def copy(self) -> SlotRecord:
        return SlotRecord(list(self.token_ids), list(self.labels))

    def write(self, runs: Iterable[Run], token_ids: Sequence[int], labels: Sequence[int]) -> None:
        """The tokens token_ids, with their labels, now sit in the slots of `runs`, in order."""
        written = 0
        for start, stop in runs:
            self.token_ids[start:stop] = token_ids[written : written + stop - start]
            self.labels[start:stop] = labels[written : written + stop - start]
            written += stop - start

    def read(self, runs: Iterable[Run]) -> tuple[list[int], list[int]]:
        """The ids and labels in the slots of `runs`, in order."""
        token_ids: list[int] = []
        labels: list[int] = []
        for start, stop in runs:
            token_ids += self.token_ids[start:stop]
            labels += self.labels[start:stop]
        return token_ids, labels

    def held(self, ledger: StreamLedger) -> HeldTokens:
        """What the slots the ledger holds say, in stream order."""
        sinks = (0, ledger.sinks_held)
        window_ids, window_labels = self.read(_window_slots(ledger))
        return HeldTokens(
            sink_ids=tuple(self.token_ids[slice(*sinks)]),
            sink_labels=tuple(self.labels[slice(*sinks)]),
            window_ids=tuple(window_ids),
            window_labels=tuple(window_labels),
            forgotten=ledger.forgotten,
            last_forgotten_label=ledger.last_forgotten_label,
        )

    def put_held(self, ledger: StreamLedger, held: HeldTokens) -> None:
        """Make the slots the ledger holds say `held` (a saved state read back), what it forgot included."""
        if (len(held.sink_ids), len(held.window_ids)) != (ledger.sinks_held, ledger.ring.length):
            raise CacheStateError("the saved state does not fit this session (its tokens and its cache disagree)")
        if held.forgotten < ledger.evicted:
            raise CacheStateError("the saved state does not fit this session (it forgot fewer tokens than evicted)")
        self.write([(0, ledger.sinks_held)], held.sink_ids, held.sink_labels)
        self.write(_window_slots(ledger), held.window_ids, held.window_labels)
        ledger.skipped = held.forgotten - ledger.evicted
        ledger.last_forgotten_label = held.last_forgotten_label


def _window_slots(ledger: StreamLedger) -> list[Run]:
    """The physical slots of the window's tokens, oldest first."""
    return [(ledger.sinks + start, ledger.sinks + stop) for start, stop in ledger.ring.held()]
