"""Sinks read once for every conversation that begins alike: by default, the system turn a server's conversations share.

    shared = SharedSinks()
    taken = shared.take(cache, ids, label, reading)   # ids: the sinks a new conversation's first prompt begins with
    # "copied": they are in `cache` now, as the conversation that read them first left them
    # "read":   none are kept yet: this conversation reads them (`reading`, its request), then
    #           shared.keep(cache, ids, label) (or shared.forget_reading(...) when it could not)
    # "wait":   another conversation is reading the same sinks: wait for shared.reader(cache, ids, label) to end
    #           in the engine's steps, then take again

The cache keeps the system turn as its sinks, and a server's clients mostly send the same
one, so every new conversation would read the same tokens into the same first slots.
Reading them is pure work: attention is causal and positions are assigned within the
cache, so a sink's keys and values depend on the sinks' tokens alone. A conversation that
shares them reads them in a forward pass of their own, not with the rest of its prompt, so
a copy is what reading them would leave: bit for bit when the first reader had its step to
itself, and otherwise within the rounding any step shared with other conversations brings
(engine/engine.py: Runner).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

from streamchat import defaults
from streamchat.cache.sink_cache import SinkCache
from streamchat.cache.snapshots import CacheSnapshot
from streamchat.engine.work import Request

Taken = Literal["copied", "read", "wait"]
# The sinks' tokens, the label they are recorded with, and the cache's shape (sinks, window).
_Key = tuple[tuple[int, ...], int, int, int]


class SharedSinks:
    """The sinks of the last few kinds of conversation begun over one model, kept to be copied into new ones."""

    def __init__(self, limit: int = defaults.SHARED_SINKS_KEPT) -> None:
        self.limit = limit
        self.copies = 0  # conversations that took their sinks from here rather than reading them
        self._kept: OrderedDict[_Key, CacheSnapshot] = OrderedDict()  # least recently taken first
        self._reading: dict[_Key, Request] = {}  # the request reading each kind of sinks now

    def take(self, cache: SinkCache, ids: list[int], label: int, reader: Request) -> Taken:
        """The sinks `ids`, recorded with `label`, copied into the empty `cache` when they are kept; else who reads
        them: `reader` (the request that would read them), or another (see the module's docstring)."""
        key = _key(cache, ids, label)
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            kept.restore(cache)
            self.copies += 1
            return "copied"
        if key in self._reading:
            return "wait"
        self._reading[key] = reader
        return "read"

    def reader(self, cache: SinkCache, ids: list[int], label: int) -> Request:
        """The request reading the sinks `ids` now (take() said "wait")."""
        return self._reading[_key(cache, ids, label)]

    def keep(self, cache: SinkCache, ids: list[int], label: int) -> None:
        """`cache` holds the sinks `ids` alone, just read: kept for the conversations that begin alike."""
        key = _key(cache, ids, label)
        self._reading.pop(key, None)
        self._kept[key] = CacheSnapshot.whole(cache)
        while len(self._kept) > self.limit:
            self._kept.popitem(last=False)

    def forget_reading(self, cache: SinkCache, ids: list[int], label: int) -> None:
        """The conversation that was reading the sinks `ids` did not (stopped, failed): the next one reads them."""
        self._reading.pop(_key(cache, ids, label), None)


def _key(cache: SinkCache, ids: list[int], label: int) -> _Key:
    return tuple(ids), label, cache.sinks, cache.window
