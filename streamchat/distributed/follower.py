"""The ranks other than 0: make the same ChatSession calls rank 0 makes, with no terminal.

A follower never reads the terminal or writes a file; it prints nothing. Errors every
rank meets alike (a bad command) are rank 0's to report. A failure of its own (out of
memory) or of its peers ends it with RankLostError, which the app prints as one line.
"""

from __future__ import annotations

from streamchat.conversation.session import ChatSession
from streamchat.distributed.lockstep import EXIT, SESSION_CALLS, Lockstep, lost_ranks_reported
from streamchat.errors import OutOfMemoryError, RankLostError, StreamchatError


def follow(session: ChatSession, lockstep: Lockstep) -> None:
    """Carry out rank 0's requests until it says exit (or it is gone: RankLostError)."""
    while (request := lockstep.receive()).call != EXIT:
        if request.call not in SESSION_CALLS:
            raise RankLostError(f"rank {lockstep.rank} got a request it does not know: {request.call!r}")
        try:
            with lost_ranks_reported(lockstep.rank, f"running {request.call}"):
                result = getattr(session, request.call)(*request.args)
                for _ in result or ():
                    pass
        except OutOfMemoryError as error:
            lost = RankLostError(f"rank {lockstep.rank}: {error}")
            lost.exit_code = error.exit_code
            raise lost from None
        except RankLostError:
            raise
        except StreamchatError:
            continue  # rank 0 met the same error at the same point, and reports it
