"""One worker, many conversations: replies interleaved step by step are the replies each gets alone."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

from tests.serve.conftest import raw_request, wait_idle


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
    alone = start_server(endless, window=48, shares_sinks=False)  # one at a time, each its own sinks
    expected = [conversation(alone, name) for name in names]
    together = start_server(endless, window=48, max_conversations=4)
    with ThreadPoolExecutor(len(names)) as threads:
        got = list(threads.map(lambda name: conversation(together, name), names))
    assert got == expected
    assert len({tuple(replies) for replies in expected}) == 4  # four different conversations
    assert len(together.pool.conversations) == 4
    engine = together.pool.served.driver.engine
    assert engine.rows_fed > engine.steps  # replies were decoded together, several rows a step
    assert engine.chunk_tokens > 0  # and the prompts read in the engine's steps
    assert engine.runner.members == []  # every reply left the decode pool when it ended


def test_concurrent_streams_with_their_own_seeds_and_evictions_equal_each_served_alone(start_server, endless) -> None:
    """Sampled replies (each its seed and temperature), long enough to evict, streamed side by side."""

    def streamed(server, index: int) -> list[str]:
        history, replies = [{"role": "system", "content": f"You are helper {index}."}], []
        for turn in range(2):
            history.append({"role": "user", "content": f"Question {turn} of {index}."})
            body = {
                "messages": history,
                "stream": True,
                "max_tokens": 40 + 7 * index,
                "temperature": 0.5 + 0.1 * index,
                "seed": 100 + index,
            }
            with server.http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
                lines = [line for line in response.iter_lines() if line.startswith("data: {")]
            text = "".join(
                chunk["choices"][0]["delta"].get("content", "")
                for chunk in (json.loads(line[6:]) for line in lines)
                if chunk["choices"]
            )
            history.append({"role": "assistant", "content": text})
            replies.append(text)
        return replies

    alone = start_server(endless, window=40, shares_sinks=False)
    expected = [streamed(alone, index) for index in range(5)]
    together = start_server(endless, window=40, max_conversations=5)
    with ThreadPoolExecutor(5) as threads:
        got = list(threads.map(lambda index: streamed(together, index), range(5)))
    assert got == expected
    assert len({tuple(replies) for replies in expected}) == 5
    engine = together.pool.served.driver.engine
    assert engine.rows_fed > engine.steps


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


def test_abandoned_endless_requests_do_not_stall_the_server(start_server, endless) -> None:
    server = start_server(endless, max_conversations=2, max_waiting=10)
    body = json.dumps({"messages": [{"role": "user", "content": "Count upward forever"}], "max_tokens": 10**9})
    for _ in range(10):  # each client gives up at once: its turn ends where it stands
        with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as sock:
            sock.sendall(raw_request(body.encode()))
    # Answered, though every live session was taken by a reply of a billion tokens that nobody waits for.
    reply = server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert reply.usage.completion_tokens == 4
    wait_idle(server)
    for path in server.sessions.glob("*.jsonl"):
        last = json.loads(path.read_text(encoding="utf-8").splitlines()[-1])
        assert last["type"] == "reply" and last.get("stop_reason") in ("interrupted", "max_new_tokens")


def test_a_burst_of_more_clients_than_conversations_waits_in_line_and_every_one_is_answered(
    start_server, endless
) -> None:
    server = start_server(endless, window=48, max_conversations=2, max_waiting=16)

    def ask(index: int) -> int:
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"Client {index} says hi."}]}
        reply = server.client.chat.completions.create(**body, max_tokens=6)
        return reply.usage.completion_tokens

    with ThreadPoolExecutor(12) as threads:
        assert list(threads.map(ask, range(12))) == [6] * 12  # none turned away, though 10 had to wait
    wait_idle(server)
    assert server.worker.admitted == 0 and len(list(server.sessions.glob("*.jsonl"))) == 12
