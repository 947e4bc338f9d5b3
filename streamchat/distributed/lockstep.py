"""What keeps the ranks in lockstep: rank 0's requests, and every step's token.

Rank 0 broadcasts each request over the request group, pickled: a Move
(streamchat.conversation.calls: a turn, a command, a setting) that every rank applies to
its session, or Exit. Within a reply, rank 0 draws each token and broadcasts it, or -1
where its reply stops (a Ctrl-C): the ranks feed the same token, or stop at the same
place, whatever their logits. Between the forward passes of a long prompt, rank 0
broadcasts whether it was asked to stop. One small broadcast per step, on the default group.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from streamchat.conversation.calls import Move
from streamchat.distributed.group import Group, first_line
from streamchat.errors import OutOfMemoryError, PeerLostError, RankLostError

# The token value that says "the reply stops here" (token ids are never negative).
STOP = -1
# How a collective says that a peer is gone or late: torch's own error types, or gloo and NCCL's wording.
_PEER_FAILURE_WORDING = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout")


@dataclass(frozen=True)
class Exit:
    """Rank 0's last request: the run is over."""


# What rank 0 sends the other ranks (nothing else).
Request = Move[Any] | Exit


class Lockstep:
    """This rank's end of the lockstep (a generation.decoder.LockstepChannel)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.rank = group.ranks.rank
        self.leads = group.ranks.leads
        self._step = torch.zeros(1, dtype=torch.long, device=group.device)

    # ---- requests (request group) -----------------------------------------------------------

    def send(self, request: Request) -> None:
        """Rank 0: have every rank apply this move (or exit)."""
        import torch.distributed as dist

        with lost_ranks_reported(self.rank, "sending a request"):
            dist.broadcast_object_list([request], src=0, group=self.group.requests)

    def receive(self) -> Request:
        """The others: wait for rank 0's next request."""
        import torch.distributed as dist

        box: list[Any] = [None]
        with lost_ranks_reported(self.rank, "waiting for rank 0"):
            dist.broadcast_object_list(box, src=0, group=self.group.requests)
        return known_request(box[0], self.rank)

    # ---- steps (default group) ----------------------------------------------------------------

    def share_token(self, token: int | None) -> int | None:
        value = self._broadcast(STOP if token is None else token, "sharing a token")
        return None if value == STOP else value

    def agree_stop(self, requested: bool) -> bool:
        return self._broadcast(int(requested), "agreeing on a stop") == 1

    def _broadcast(self, value: int, what: str) -> int:
        import torch.distributed as dist

        if self.leads:
            self._step.fill_(value)
        with lost_ranks_reported(self.rank, what):
            dist.broadcast(self._step, src=0)
            return int(self._step.item())


def is_peer_failure(error: BaseException) -> bool:
    """Whether a collective failed because another rank died, hung or left."""
    import torch.distributed as dist

    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(word in str(error).lower() for word in _PEER_FAILURE_WORDING)


@contextmanager
def lost_ranks_reported(rank: int, what: str) -> Iterator[None]:
    """A collective that fails because of another rank, as RankLostError naming this rank and why."""
    try:
        yield
    except Exception as error:
        if not is_peer_failure(error):
            raise
        raise PeerLostError(f"rank {rank} lost the other ranks while {what}: {peer_failure_words(error)}") from None


def peer_failure_words(error: BaseException) -> str:
    """gloo's and NCCL's message, to its first sentence (the rest is advice for bug reports)."""
    line = first_line(error)
    return line.split(". ", 1)[0].rstrip(".")


def known_request(received: object, rank: int) -> Request:
    """What rank 0 sent, when it is a request; RankLostError for anything else (a streamchat of another version)."""
    if not isinstance(received, Move | Exit):
        raise RankLostError(f"rank {rank} got a request it does not know: {received!r}")
    return received


@contextmanager
def out_of_step_failures(rank: int, what: str, aftermath: str = "") -> Iterator[None]:
    """A failure that leaves this rank out of step with the others, as RankLostError: it ends the run.

    A lost peer is PeerLostError (see lost_ranks_reported: `what` this rank was doing). Out
    of memory on this rank (its forward pass broke off while the others wait in a
    collective) cannot be recovered from as in one process: it becomes RankLostError with
    out of memory's message (then `aftermath`) and exit code. Deterministic errors (a bad
    command) pass: every rank meets them at the same point.
    """
    try:
        with lost_ranks_reported(rank, what):
            yield
    except OutOfMemoryError as error:
        lost = RankLostError(f"rank {rank}: {error}{aftermath}")
        lost.exit_code = error.exit_code
        raise lost from None
