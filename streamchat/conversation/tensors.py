"""A session's tensors between two turns, by name: its cache, the mirror of what the cache holds, its sampler.

Put back into a session with the same model, keep and window, the next seeded reply is
token for token the one the session would have given had it never stopped: the cache
continues bit for bit (streamchat.cache.snapshots), the mirror tells the same story of
what was forgotten, and the sampler draws the same numbers.

    cache.*                 streamchat.cache.snapshots.cache_state(): slots, pristine sinks, ledger
    mirror.sinks            [n, 2] int64: token id and message index of each kept token
    mirror.window           [m, 2] int64: the same for the window, oldest first
    mirror.forgotten        [2] int64: tokens forgotten, the message the latest of them came from
    sampler.random_state    uint8: the generator's state, absent before the session's first draw
"""

from __future__ import annotations

from collections import deque

import torch

from streamchat.cache import SinkCache
from streamchat.cache.snapshots import cache_state, load_cache_state
from streamchat.conversation.state import TensorState
from streamchat.errors import CacheStateError
from streamchat.generation.mirror import CacheMirror
from streamchat.generation.sampling import Sampler

CACHE_PREFIX = "cache."
RANDOM_STATE = "sampler.random_state"


def tensors_of(cache: SinkCache, mirror: CacheMirror, sampler: Sampler) -> TensorState:
    """The tensors of a cache, its mirror and a sampler, copied to the CPU."""
    tensors = {CACHE_PREFIX + name: tensor for name, tensor in cache_state(cache).items()}
    tensors["mirror.sinks"] = _pairs(mirror.sinks)
    tensors["mirror.window"] = _pairs(mirror.window)
    tensors["mirror.forgotten"] = torch.tensor([mirror.forgotten, mirror.last_forgotten_message])
    random_state = sampler.random_state()
    if random_state is not None:
        tensors[RANDOM_STATE] = random_state.cpu()
    return TensorState(tensors, sampler.seed)


def restore_tensors(cache: SinkCache, state: TensorState, device: torch.device) -> tuple[CacheMirror, Sampler]:
    """Load `state` into `cache`; the mirror and sampler that go with it. CacheStateError when it does not fit.

    The cache may have been written by the time the error is raised, so after one the
    caller starts over (a replay resets it).
    """
    tensors = state.tensors
    try:
        load_cache_state(
            cache, {n.removeprefix(CACHE_PREFIX): t for n, t in tensors.items() if n.startswith(CACHE_PREFIX)}
        )
        mirror = CacheMirror(cache.sinks)
        mirror.sinks = [(token, message) for token, message in tensors["mirror.sinks"].tolist()]
        mirror.window = deque((token, message) for token, message in tensors["mirror.window"].tolist())
        mirror.forgotten, mirror.last_forgotten_message = tensors["mirror.forgotten"].tolist()
    except (KeyError, ValueError, RuntimeError) as error:
        raise CacheStateError(f"the saved state does not fit this session ({error})") from error
    stats = cache.stats()
    if (len(mirror.sinks), len(mirror.window)) != (stats.sinks_held, stats.window_used):
        raise CacheStateError("the saved state does not fit this session (its tokens and its cache disagree)")
    sampler = Sampler(state.seed)
    if RANDOM_STATE in tensors:
        sampler.set_random_state(tensors[RANDOM_STATE], device)
    return mirror, sampler


def _pairs(items: list[tuple[int, int]] | deque[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(list(items), dtype=torch.int64).reshape(-1, 2)  # [n, 2], also when empty
