"""Endless conversations from a stateless API: a resent history continues its conversation, reading only
the new turn; a conversation named by its header goes on from its new message alone."""

from __future__ import annotations

import json
import shlex
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from streamchat.conversation.kept_prefix import system_turn_length
from streamchat.conversation.template import ChatFormat
from streamchat.storage.session_file import read_session
from tests.serve.conftest import HELLO_BODY, REPLY, SETTINGS, raw_request, wait_idle
from tests.support.waiting import wait_until


def new_turn_tokens(tokenizer, text: str, first: bool, system: str | None = None) -> int:
    return len(ChatFormat(tokenizer, system_prompt=system).prompt_ids(text, first_turn=first))


def test_a_history_resent_thirty_times_reads_only_each_new_turn(start_server, endless) -> None:
    server = start_server(endless, window=48)
    _, tokenizer = endless
    system = "Be brief."
    messages = [{"role": "system", "content": system}]
    conversations, evicted = set(), []
    for turn in range(30):
        text = f"turn {turn}"
        messages.append({"role": "user", "content": text})
        raw = server.client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=6, temperature=0
        )
        reply = raw.parse()
        conversations.add(raw.headers["x-streamchat-conversation"])
        evicted.append(int(raw.headers["x-streamchat-cache"].rsplit(" ", 1)[1]))
        usage = reply.usage
        read = usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
        assert read == new_turn_tokens(tokenizer, text, turn == 0, system), turn
        assert reply.choices[0].finish_reason == "length" and usage.completion_tokens == 6
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert len(conversations) == 1
    assert evicted[0] == 0 and evicted[-1] > 200  # the window holds 48 tokens: most of the conversation left it
    assert usage.prompt_tokens > 48 * 4  # every turn counted, though the cache holds only 4 + 48
    (conversation,) = conversations
    saved = read_session(server.sessions / f"{conversation}.jsonl")
    assert (saved.system_prompt, saved.messages) == (system, messages[1:])


def test_new_conversations_that_begin_alike_read_the_sinks_once_and_report_them_cached(start_server, endless) -> None:
    server = start_server(endless)  # its sessions keep 4 sinks
    _, tokenizer = endless
    usages, replies = [], []
    for text in ("Hello there.", "Good morning.", "Hello there."):
        raw = server.client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}],
            max_tokens=6,
            temperature=0,
        )
        usages.append(raw.parse().usage)
        replies.append(raw.parse().choices[0].message.content)
    prompts = [new_turn_tokens(tokenizer, text, True, "Be brief.") for text in ("Hello there.", "Good morning.")]
    assert [usage.prompt_tokens for usage in usages] == [prompts[0], prompts[1], prompts[0]]
    # The first read the 4 sinks; the others copied them in: not read for their requests.
    assert [usage.prompt_tokens_details.cached_tokens for usage in usages] == [0, 4, 4]
    assert replies[2] == replies[0]  # the same first message, sinks read or copied: the same greedy reply


def test_a_server_reads_its_default_system_turn_at_start_and_its_first_conversations_copy_it(
    start_server, endless
) -> None:
    _, tokenizer = endless
    system = "You answer in one word."
    warm = start_server(endless, keep="system", system=system, max_conversations=3)
    cold = start_server(endless, keep="system", system=system, shares_sinks=False)  # each reads its sinks
    sinks = system_turn_length(ChatFormat(tokenizer, system_prompt=system))  # what keep="system" keeps
    engine = warm.pool.served.driver.engine
    assert engine.runner.batch.capacity == 4  # rows for every live conversation (a power of two), before any came
    steps = engine.steps
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there."}], "max_tokens": 8}
    first = warm.client.chat.completions.create(**body, temperature=0)
    usage = first.usage
    assert usage.prompt_tokens_details.cached_tokens == sinks > 0  # copied in: read at the start, not for it
    assert usage.prompt_tokens == new_turn_tokens(tokenizer, "Hello there.", True, system)
    # The same reply as from sinks read with the prompt.
    assert first.choices[0].message == cold.client.chat.completions.create(**body, temperature=0).choices[0].message
    assert engine.steps > steps and warm.pool.served.shared_sinks.copies == 1


def test_a_history_the_server_does_not_hold_starts_a_conversation_by_replay(start_server, scripted) -> None:
    server = start_server(scripted)
    history = [
        {"role": "user", "content": "Earlier."},
        {"role": "assistant", "content": "Written elsewhere."},
        {"role": "user", "content": "Now?"},
    ]
    raw = server.client.chat.completions.with_raw_response.create(model="tiny", messages=history)
    reply = raw.parse()
    assert reply.choices[0].message.content == REPLY
    usage = reply.usage
    assert usage.prompt_tokens_details.cached_tokens == 0  # the history fits the window: all of it was read
    saved = read_session(server.sessions / f"{raw.headers['x-streamchat-conversation']}.jsonl")
    assert saved.messages == [*history, {"role": "assistant", "content": REPLY}]
    # Another history it does not hold, beginning alike: its replay copies the 4 sinks the first one read.
    other = [history[0], {"role": "assistant", "content": "Written elsewhere, and otherwise."}, history[-1]]
    again = server.client.chat.completions.create(model="tiny", messages=other).usage
    assert again.prompt_tokens_details.cached_tokens == 4 and again.prompt_tokens > 4


def test_a_conversation_named_by_its_header_goes_on_from_its_new_message(start_server, scripted) -> None:
    server = start_server(scripted)
    _, tokenizer = scripted
    first = server.client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "One."}]
    )
    conversation = first.headers["x-streamchat-conversation"]
    second = server.client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=[{"role": "user", "content": "Two."}],
        extra_headers={"X-Streamchat-Conversation": conversation},
    )
    assert second.headers["x-streamchat-conversation"] == conversation
    usage = second.parse().usage
    assert usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens == new_turn_tokens(tokenizer, "Two.", False)
    earlier = [{"role": "user", "content": "One."}, {"role": "assistant", "content": REPLY}]
    rendered = sum(len(ids) for ids in ChatFormat(tokenizer, system_prompt=None).conversation_ids(earlier))
    assert usage.prompt_tokens_details.cached_tokens == rendered  # the first turn, its reply and its end
    saved = read_session(server.sessions / f"{conversation}.jsonl")
    assert [message["content"] for message in saved.messages] == ["One.", REPLY, "Two.", REPLY]


ASKED = [{"role": "user", "content": "Go on and on."}]


def left_mid_stream(server, kept: int) -> tuple[str, str]:
    """A client asks ASKED, streamed, reads eight lines and leaves; the conversation, and the text of the first
    `kept` lines (what the client kept of what it was sent)."""
    body = {"messages": ASKED, "stream": True, "max_tokens": 5000}
    with server.http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        conversation = response.headers["x-streamchat-conversation"]
        lines = response.iter_lines()
        received = [next(lines) for _ in range(8)]
    wait_idle(server)
    told = "".join(
        json.loads(line.removeprefix("data: "))["choices"][0]["delta"].get("content", "")
        for line in received[:kept]
        if line
    )
    return conversation, told


def test_a_client_gone_mid_stream_resends_what_it_was_sent_and_goes_on(start_server, endless) -> None:
    server = start_server(endless)
    # The server knows what it sent, not what the client read: the client keeps only its first few pieces.
    conversation, told = left_mid_stream(server, kept=5)
    assert told
    history = [*ASKED, {"role": "assistant", "content": told}, {"role": "user", "content": "And then?"}]
    again = server.post({"messages": history, "max_tokens": 3})
    assert (again.status_code, again.headers["x-streamchat-conversation"]) == (200, conversation)
    # The part of the reply the client never saw was taken back: the conversation is what the client has.
    saved = read_session(server.sessions / f"{conversation}.jsonl")
    assert saved.messages[:3] == history
    assert len(list(server.sessions.glob("*.jsonl"))) == 1


def test_a_whole_reply_whose_client_left_is_taken_back_when_the_request_is_sent_again(start_server, endless) -> None:
    server = start_server(endless)
    body = {"messages": [{"role": "user", "content": "Count upward forever: 1, 2, 3,"}], "max_tokens": 10**9}
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(raw_request(json.dumps(body).encode()))
        under_way = lambda: any(conversation.busy for conversation in list(server.pool.conversations.values()))  # noqa: E731
        wait_until(under_way, "the reply to be under way")
    wait_idle(server)  # the reply stopped within a step of the client leaving
    (path,) = server.sessions.glob("*.jsonl")
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert (records[-1]["type"], records[-1]["stop_reason"]) == ("reply", "interrupted")
    again = server.post({**body, "max_tokens": 3})
    assert (again.status_code, again.headers["x-streamchat-conversation"]) == (200, path.stem)
    saved = read_session(path)
    assert saved.messages == [
        *body["messages"],
        {"role": "assistant", "content": again.json()["choices"][0]["message"]["content"]},
    ]


def test_clients_sending_the_same_history_at_once_each_get_a_reply(start_server, endless) -> None:
    server = start_server(endless, max_conversations=6)
    first = server.post({**HELLO_BODY, "max_tokens": 3})
    history = [*HELLO_BODY["messages"], first.json()["choices"][0]["message"], {"role": "user", "content": "More."}]
    with ThreadPoolExecutor(6) as threads:
        replies = list(threads.map(lambda _: server.post({"messages": history, "max_tokens": 3}), range(6)))
    assert [reply.status_code for reply in replies] == [200] * 6
    assert first.headers["x-streamchat-conversation"] in {
        reply.headers["x-streamchat-conversation"] for reply in replies
    }


def test_a_requests_settings_reach_its_session_typed_and_the_next_request_starts_from_the_servers(
    start_server, scripted
) -> None:
    server = start_server(scripted)
    stop = ['say "hi"', "two  words", "it's"]  # quotes and spaces, as no shell would keep them
    raw = server.client.chat.completions.with_raw_response.create(
        model="tiny", messages=HELLO_BODY["messages"], stop=stop, temperature=0.5, seed=11, max_tokens=20
    )
    conversation = raw.headers["x-streamchat-conversation"]
    session = server.pool.conversations[conversation].session
    assert session.settings == SETTINGS.changed(
        {"stop": tuple(stop), "temperature": 0.5, "seed": 11, "max_new_tokens": 20}
    )
    saved = read_session(server.sessions / f"{conversation}.jsonl")
    assert saved.settings["stop"] == shlex.join(stop)  # the journal's text, as it always was
    messages = [*HELLO_BODY["messages"], {"role": "assistant", "content": REPLY}, {"role": "user", "content": "And?"}]
    server.client.chat.completions.create(model="tiny", messages=messages)  # the same conversation, nothing set
    assert server.pool.conversations[conversation].session.settings == SETTINGS


@pytest.mark.parametrize("kept", [5, 0])
def test_after_a_restart_a_client_that_left_mid_stream_goes_on_from_what_it_kept(start_server, endless, kept) -> None:
    first = start_server(endless)
    conversation, told = left_mid_stream(first, kept)
    first.worker.close()  # the server stops: every conversation parked, every journal let go
    # The client kept the first few pieces it was sent (or none), and sends its next message to a new server.
    history = [*ASKED, {"role": "assistant", "content": told}, {"role": "user", "content": "And then?"}]
    history = history if told else ASKED  # none of the reply kept: the question asked again
    again = start_server(endless, sessions=first.sessions)
    answered = again.post({"messages": history, "max_tokens": 3})
    assert (answered.status_code, answered.headers["x-streamchat-conversation"]) == (200, conversation)
    saved = read_session(first.sessions / f"{conversation}.jsonl")
    assert saved.messages[: len(history)] == history and len(saved.messages) == len(history) + 1
    assert len(list(first.sessions.glob("*.jsonl"))) == 1
