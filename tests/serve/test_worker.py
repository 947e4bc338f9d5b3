"""One worker, many conversations: replies interleaved step by step are the replies each gets alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def conversation(server, name: str, turns: int = 3) -> list[str]:
    history, replies = [], []
    for turn in range(turns):
        history.append({"role": "user", "content": f"{name}, turn {turn}: tell me more."})
        reply = server.client.chat.completions.create(model="tiny", messages=history, max_tokens=12)
        text = reply.choices[0].message.content
        history.append({"role": "assistant", "content": text})
        replies.append(text)
    return replies


def test_four_concurrent_conversations_each_equal_to_itself_served_alone(start_server, endless) -> None:
    names = ["alpha", "beta", "gamma", "delta"]
    alone = start_server(endless, window=48)
    expected = [conversation(alone, name) for name in names]
    together = start_server(endless, window=48, max_conversations=4)
    with ThreadPoolExecutor(len(names)) as threads:
        got = list(threads.map(lambda name: conversation(together, name), names))
    assert got == expected
    assert len({tuple(replies) for replies in expected}) == 4  # four different conversations
    assert len(together.pool.conversations) == 4


def test_a_long_reply_does_not_hold_another_conversation_back(start_server, endless) -> None:
    server = start_server(endless)
    long = {"messages": [{"role": "user", "content": "A long one."}], "stream": True, "max_tokens": 100_000}
    with server.http.stream("POST", f"{server.url}/v1/chat/completions", json=long) as response:
        lines = response.iter_lines()  # kept: a dropped line iterator closes the response
        next(lines)
        # While the long reply streams, a short one in another conversation is answered whole.
        short = server.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Short."}], max_tokens=3
        )
        assert short.usage.completion_tokens == 3
        assert any(conversation.busy for conversation in server.pool.conversations.values())
