"""A session's tensors between two turns, by name: its cache, the record of what the cache holds, its sampler.

Put back into a session with the same model, keep and window, the next seeded reply is
token for token the one the session would have given had it never stopped: the cache
continues bit for bit (streamchat.cache.snapshots), its record tells the same story of
what was forgotten, and the sampler draws the same numbers.

    cache.*                 a whole CacheSnapshot's tensors (streamchat.cache.snapshots): slots, sinks, ledger
    mirror.sinks            [n, 2] int64: token id and message index (its label) of each kept token
    mirror.window           [m, 2] int64: the same for the window, oldest first
    mirror.forgotten        [2] int64: tokens forgotten, the message the latest of them came from
    sampler.random_state    uint8: the generator's state, absent before the session's first draw

The mirror.* tensors are the cache's record of its held tokens (streamchat.cache.record),
named as they were when a mirror beside the cache kept them: files of either time read alike.
"""

from __future__ import annotations

import torch

from streamchat.cache import SinkCache
from streamchat.cache.record import HeldTokens
from streamchat.cache.snapshots import CacheSnapshot
from streamchat.conversation.state import TensorState
from streamchat.errors import CacheStateError
from streamchat.generation.sampling import Sampler

CACHE_PREFIX = "cache."
RANDOM_STATE = "sampler.random_state"


def tensors_of(cache: SinkCache, sampler: Sampler) -> TensorState:
    """The tensors of a cache, its record and a sampler, copied to the CPU."""
    tensors = {CACHE_PREFIX + name: tensor for name, tensor in CacheSnapshot.whole(cache).tensors().items()}
    held = cache.held_tokens()
    tensors["mirror.sinks"] = _pairs(held.sink_ids, held.sink_labels)
    tensors["mirror.window"] = _pairs(held.window_ids, held.window_labels)
    tensors["mirror.forgotten"] = torch.tensor([held.forgotten, held.last_forgotten_label])
    random_state = sampler.random_state()
    if random_state is not None:
        tensors[RANDOM_STATE] = random_state.cpu()
    return TensorState(tensors, sampler.seed)


def restore_tensors(cache: SinkCache, state: TensorState, device: torch.device) -> Sampler:
    """Load `state` into `cache`; the sampler that goes with it. CacheStateError when it does not fit.

    The cache may have been written by the time the error is raised, so after one the
    caller starts over (a replay resets it).
    """
    tensors = state.tensors
    try:
        saved = {name.removeprefix(CACHE_PREFIX): t for name, t in tensors.items() if name.startswith(CACHE_PREFIX)}
        CacheSnapshot.from_tensors(saved, cache).restore(cache)
        sinks, window = tensors["mirror.sinks"].tolist(), tensors["mirror.window"].tolist()
        forgotten, last_forgotten_label = tensors["mirror.forgotten"].tolist()
    except (KeyError, ValueError, RuntimeError) as error:
        raise CacheStateError(f"the saved state does not fit this session ({error})") from error
    cache.restore_held(
        HeldTokens(
            sink_ids=tuple(token for token, _ in sinks),
            sink_labels=tuple(label for _, label in sinks),
            window_ids=tuple(token for token, _ in window),
            window_labels=tuple(label for _, label in window),
            forgotten=forgotten,
            last_forgotten_label=last_forgotten_label,
        )
    )
    sampler = Sampler(state.seed)
    if RANDOM_STATE in tensors:
        sampler.set_random_state(tensors[RANDOM_STATE], device)
    return sampler


def _pairs(token_ids: tuple[int, ...], labels: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(list(zip(token_ids, labels, strict=True)), dtype=torch.int64).reshape(-1, 2)  # [n, 2]
