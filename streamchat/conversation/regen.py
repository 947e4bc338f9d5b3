"""What /regen goes back to: the cache (its record of what it holds included) and the logits after the last prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from streamchat.cache.snapshots import CacheSnapshot

if TYPE_CHECKING:
    from streamchat.generation.token_loop import TokenLoop


@dataclass
class RegenPoint:
    """The cache right after the last prompt: /regen restores it and draws a new reply."""

    cache: CacheSnapshot
    logits: torch.Tensor

    @classmethod
    def take(cls, loop: TokenLoop, reach: int, logits: torch.Tensor) -> RegenPoint:
        """The point `loop` is at, before a reply that feeds at most `reach` tokens."""
        # Only what the reply can overwrite is saved: as many slots as it can feed tokens.
        return cls(CacheSnapshot.take(loop.cache, reach), logits.clone())

    def restore(self, loop: TokenLoop) -> torch.Tensor:
        """Put `loop` back where the point was taken; the logits to draw the reply from."""
        self.cache.restore(loop.cache)
        return self.logits
