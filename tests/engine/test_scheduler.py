"""The scheduler: every reply's token once the whole pool queued, then chunks, oldest first, within the budget."""

from __future__ import annotations

import torch

from streamchat.engine.scheduler import schedule
from streamchat.engine.work import DecodeRow, PromptChunk, Ticket


class Cache:
    """Stands for a SinkCache: the scheduler only tells caches apart."""


def row(cache: Cache) -> Ticket:
    return Ticket(DecodeRow(cache, torch.tensor([1])), None)


def chunk(cache: Cache, tokens: int) -> Ticket:
    return Ticket(PromptChunk(cache, torch.ones(1, tokens, dtype=torch.long)), None)


def test_decode_rows_run_in_the_pools_row_order_with_joiners_last():
    first, second, joiner = Cache(), Cache(), Cache()
    queued = [row(joiner), row(second), row(first)]
    step = schedule(queued, [first, second], token_budget=8)
    assert [ticket.work.cache for ticket in step.rows] == [first, second, joiner]
    assert step.chunks == []


def test_decode_rows_wait_until_every_member_of_the_pool_queued_its_token():
    first, second, reading = Cache(), Cache(), Cache()
    read = chunk(reading, 5)
    step = schedule([row(first), read], [first, second], token_budget=64)
    assert step.rows == [] and step.chunks == [read]  # the chunk does not wait for the rows


def test_chunks_go_oldest_first_while_the_budget_holds_and_a_later_one_never_overtakes():
    member, a, b, c = Cache(), Cache(), Cache(), Cache()
    queued = [row(member), chunk(a, 4), chunk(b, 6), chunk(c, 1)]
    step = schedule(queued, [member], token_budget=10)
    # 1 row + 4 fit; 6 more would be 11 > 10, and c (1 token) waits behind b
    assert [ticket.work.cache for ticket in step.chunks] == [a]
    assert len(step.tickets) == 2


def test_the_oldest_chunk_always_goes_whatever_its_length():
    member, long = Cache(), Cache()
    step = schedule([row(member), chunk(long, 300)], [member], token_budget=16)
    assert len(step.rows) == 1 and [ticket.work.tokens for ticket in step.chunks] == [300]


def test_nothing_queued_schedules_nothing():
    assert not schedule([], [Cache()], token_budget=16)
