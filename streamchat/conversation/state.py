"""A chat session's whole state between turns, as named tensors: the cache, its mirror, the sampler's place.

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
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from streamchat.cache.snapshots import cache_state, load_cache_state
from streamchat.errors import CacheStateError
from streamchat.generation.mirror import CacheMirror
from streamchat.generation.sampling import Sampler
from streamchat.storage.cache_file import StateKey, conversation_digest, write_state

if TYPE_CHECKING:
    from streamchat.conversation.session import ChatSession

CACHE_PREFIX = "cache."
RANDOM_STATE = "sampler.random_state"


def session_tensors(session: ChatSession) -> dict[str, torch.Tensor]:
    """The state of `session` between two turns, as CPU tensors ready for safetensors."""
    mirror = session.mirror
    tensors = {CACHE_PREFIX + name: tensor for name, tensor in cache_state(session.cache).items()}
    tensors["mirror.sinks"] = _pairs(mirror.sinks)
    tensors["mirror.window"] = _pairs(mirror.window)
    tensors["mirror.forgotten"] = torch.tensor([mirror.forgotten, mirror.last_forgotten_message])
    random_state = session.sampler.random_state()
    if random_state is not None:
        tensors[RANDOM_STATE] = random_state.cpu()
    return tensors


def write_session_state(session: ChatSession, path: Path, key: StateKey) -> int:
    """Write session_tensors() to `path` as a cache state file for its conversation (cache_file.py); its size."""
    seed_setting = dict(session.settings.as_pairs())["seed"]
    digest = conversation_digest(session.transcript, session.system_prompt, seed_setting)
    messages = len(session.transcript)
    return write_state(path, session_tensors(session), key, digest, messages, session.seed)


def restore_session_tensors(session: ChatSession, tensors: dict[str, torch.Tensor], seed: int) -> None:
    """Put back what session_tensors() saved, drawn with `seed`; CacheStateError when it does not fit this session.

    The mirror and the sampler change only when everything fits; the cache may have been
    written by then, so after a CacheStateError the caller starts over (a replay resets it).
    """
    try:
        cache = {name.removeprefix(CACHE_PREFIX): t for name, t in tensors.items() if name.startswith(CACHE_PREFIX)}
        load_cache_state(session.cache, cache)
        mirror = CacheMirror(session.cache.sinks)
        mirror.sinks = [(token, message) for token, message in tensors["mirror.sinks"].tolist()]
        mirror.window = deque((token, message) for token, message in tensors["mirror.window"].tolist())
        mirror.forgotten, mirror.last_forgotten_message = tensors["mirror.forgotten"].tolist()
    except (KeyError, ValueError, RuntimeError) as error:
        raise CacheStateError(f"the saved state does not fit this session ({error})") from error
    stats = session.cache.stats()
    if (len(mirror.sinks), len(mirror.window)) != (stats.sinks_held, stats.window_used):
        raise CacheStateError("the saved state does not fit this session (its tokens and its cache disagree)")
    sampler = Sampler(seed)
    if RANDOM_STATE in tensors:
        sampler.set_random_state(tensors[RANDOM_STATE], session.device)
    session.token_loop.mirror, session.sampler = mirror, sampler


def _pairs(items: list[tuple[int, int]] | deque[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(list(items), dtype=torch.int64).reshape(-1, 2)  # [n, 2], also when empty
