"""The ranks other than 0: apply the moves rank 0 makes to the same conversation, with no terminal.

A follower never reads the terminal or writes a file; it prints nothing. Errors every
rank meets alike (a bad command) are rank 0's to report. A failure of its own (out of
memory) or of its peers ends it with RankLostError, which the app prints as one line.
"""

from __future__ import annotations

import re

from streamchat.conversation.calls import ConversationMoves, Move
from streamchat.distributed.lockstep import Exit, Lockstep, out_of_step_failures
from streamchat.errors import RankLostError, StreamchatError


def follow(session: ConversationMoves, lockstep: Lockstep) -> None:
    """Apply rank 0's moves until it says exit (or it is gone: RankLostError)."""
    while not isinstance(move := lockstep.receive(), Exit):
        try:
            with out_of_step_failures(lockstep.rank, f"running {_call_name(move)}"):
                for _ in move.apply(session) or ():
                    pass
        except RankLostError:
            raise
        except StreamchatError:
            continue  # rank 0 met the same error at the same point, and reports it


def _call_name(move: Move[object]) -> str:
    """The session call a move makes, for messages: SetSystemPrompt -> set_system_prompt."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(move).__name__).lower()
