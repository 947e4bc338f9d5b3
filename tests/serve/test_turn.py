"""Endless conversations from a stateless API: a resent history continues its conversation, reading only
the new turn; a conversation named by its header goes on from its new message alone."""

from __future__ import annotations

from streamchat.conversation.template import ChatFormat
from streamchat.storage.session_file import read_session
from tests.serve.conftest import REPLY


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
