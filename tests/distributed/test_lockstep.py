"""The lockstep over a real gloo group of one rank (rank 0 alone), and how peer failures are recognised."""

import pytest
import torch.distributed as dist

from streamchat.conversation.calls import Chat
from streamchat.distributed.group import Ranks, join_group, leave_group
from streamchat.distributed.lockstep import Exit, Lockstep, is_peer_failure, known_request, lost_ranks_reported
from streamchat.distributed.supervisor import free_port
from streamchat.errors import PeerLostError, RankLostError


@pytest.fixture
def alone(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    group = join_group(Ranks(0, 1, 0), "cpu", timeout_seconds=5)
    yield Lockstep(group)
    leave_group()
    assert not dist.is_initialized()


def test_rank_0s_token_and_its_stop_come_back_as_sent(alone):
    assert alone.leads
    assert alone.share_token(417) == 417
    assert alone.share_token(None) is None  # the reply stops here
    assert alone.agree_stop(True) is True
    assert alone.agree_stop(False) is False
    alone.send(Chat("Hello"))  # to nobody: the other ranks' side runs in the multiprocess tests


def test_a_peers_death_or_silence_is_a_peer_failure_and_anything_else_is_not():
    closed = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:21633. GLHF!")
    assert is_peer_failure(closed)
    assert is_peer_failure(RuntimeError("[unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"))
    assert is_peer_failure(dist.DistNetworkError("broken"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("timed out"))
    lost = r"^rank 1 lost the other ranks while sharing a token: Connection closed by peer \[127.0.0.1\]:21633$"
    with pytest.raises(PeerLostError, match=lost), lost_ranks_reported(1, "sharing a token"):
        raise closed
    with pytest.raises(RuntimeError, match="shapes"), lost_ranks_reported(1, "sharing a token"):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")


def test_what_rank_0_sends_is_a_move_or_exit_and_nothing_else():
    assert known_request(Chat("Hello"), 1) == Chat("Hello")
    assert known_request(Exit(), 1) == Exit()
    with pytest.raises(RankLostError, match=r"^rank 1 got a request it does not know: \('save_state', '/tmp/x'\)$"):
        known_request(("save_state", "/tmp/x"), 1)
