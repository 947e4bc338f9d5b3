"""What /regen goes back to: the cache, its mirror and the logits right after the last prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from streamchat.cache.snapshots import ReplySnapshot
from streamchat.engine.mirror import CacheMirror

if TYPE_CHECKING:
    from streamchat.engine.session import ChatSession


@dataclass
class RegenPoint:
    """The cache right after the last prompt: /regen restores it and draws a new reply."""

    cache_state: ReplySnapshot
    mirror: CacheMirror
    logits: torch.Tensor

    @classmethod
    def take(cls, session: ChatSession, logits: torch.Tensor) -> RegenPoint:
        # Only what the reply can overwrite is saved: as many slots as it can feed tokens.
        reach = session.settings.max_new_tokens + len(session.chat_format.end_of_turn_ids)
        return cls(ReplySnapshot.take(session.cache, reach), session.mirror.copy(), logits.clone())

    def restore(self, session: ChatSession) -> torch.Tensor:
        """Put the session back where the point was taken; the logits to draw the reply from."""
        self.cache_state.restore(session.cache)
        session.mirror = self.mirror.copy()
        return self.logits
