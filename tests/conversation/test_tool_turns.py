"""A conversation with tools: its first turn describes them, a reply's calls and their results' turn are fed
turn by turn, and the stream is the whole conversation rendered at once (live, and replayed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamchat.conversation.message import template_messages, tool_results_message
from streamchat.conversation.session import SessionOptions
from streamchat.conversation.state import ConversationState
from streamchat.conversation.template import ChatFormat
from streamchat.errors import ChatTemplateError, ConfigError
from streamchat.generation.events import TurnFinished
from streamchat.generation.settings import GenerationSettings
from streamchat.storage.journal import Journal
from streamchat.storage.session_file import read_session, save_session
from tests.support.sessions import session_under_test
from tests.support.tokenizers import byte_level_tokenizer, byte_level_tokenizer_with
from tests.support.tool_template import TIME_TOOL, WEATHER_TOOL, scripted_tool_model, tool_tokenizer

TOOLS = [WEATHER_TOOL, TIME_TOOL]
GREEDY = GenerationSettings(max_new_tokens=8, temperature=0.0)
QWEN_TEMPLATE = Path(__file__).parents[3] / "shared/data/chat_templates/qwen2.5-instruct.jinja"
CALLS = [
    {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
]
CONVERSATION = [
    {"role": "user", "content": "Weather and time?"},
    {"role": "assistant", "content": "", "tool_calls": CALLS},
    tool_results_message(
        [{"tool_call_id": "call_a", "content": "sunny"}, {"tool_call_id": "call_b", "content": "noon"}]
    ),
    {"role": "assistant", "content": "Sunny at noon."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "Bye."},
]


def whole_render(tokenizer, messages, system=None, tools=TOOLS):
    said = [{"role": "system", "content": system}] if system else []
    text = tokenizer.apply_chat_template(said + template_messages(messages), tools=tools, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def templates():
    yield tool_tokenizer()
    if QWEN_TEMPLATE.is_file():  # the shared reference template (MIT): tests may read it, the product never does
        yield byte_level_tokenizer_with(QWEN_TEMPLATE.read_text())


@pytest.mark.parametrize(
    "tokenizer", list(templates()), ids=lambda t: "qwen" if "Qwen" in t.chat_template else "hermes"
)
@pytest.mark.parametrize("system", [None, "Be brief."])
def test_each_turn_of_a_tool_conversation_cut_alone_is_the_whole_render(tokenizer, system):
    chat_format = ChatFormat(tokenizer, system, tools=TOOLS)
    fed = [token for ids in chat_format.conversation_ids(CONVERSATION) for token in ids]
    assert fed == whole_render(tokenizer, CONVERSATION, system)


def test_tools_change_the_first_turn_and_a_template_without_them_is_refused():
    tokenizer = tool_tokenizer()
    assert ChatFormat(tokenizer, tools=TOOLS).prompt_ids("Hi", first_turn=True) != ChatFormat(tokenizer).prompt_ids(
        "Hi", first_turn=True
    )
    with pytest.raises(ChatTemplateError, match="does not describe tools"):
        ChatFormat(byte_level_tokenizer(), tools=TOOLS)


def test_a_live_tool_conversation_feeds_the_whole_render_and_is_journaled(tmp_path):
    model, tokenizer = scripted_tool_model()
    session = session_under_test(model, tokenizer, SessionOptions(settings=GREEDY, window=400))
    list(session.restore(ConversationState([], None, GREEDY, tools=TOOLS)))
    with pytest.raises(ConfigError, match="called none"):
        session.answer_tool_results([{"tool_call_id": "call_a", "content": "sunny"}])
    reply = [event for event in session.chat("Weather?") if isinstance(event, TurnFinished)][-1].reply
    assert reply.startswith("<tool_call>")
    call = {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    session.settle_tool_calls("", [call])
    list(session.driver.run(session.answer_tool_results([{"tool_call_id": "call_a", "content": "sunny"}])))
    assert [message["role"] for message in session.transcript] == ["user", "assistant", "tool", "assistant"]
    assert session.cache_view().token_ids == whole_render(tokenizer, session.transcript)
    # Replayed from its transcript, the same tokens.
    list(session.replay(list(session.transcript)))
    assert session.cache_view().token_ids == whole_render(tokenizer, session.transcript)

    journal = Journal(tmp_path, "tiny", {}, pytest.fail)
    journal.record(session.snapshot(tensors=False), "eos")
    saved = read_session(journal.path)
    assert saved.messages == session.transcript and saved.tools == TOOLS
    assert saved.state(GREEDY).tools == TOOLS


# The user's words sent with the results (an agent's reminder): one prompt turn, the results then a user message.
WITH_TEXT = [
    *CONVERSATION[:2],
    tool_results_message(
        [{"tool_call_id": "call_a", "content": "sunny"}, {"tool_call_id": "call_b", "content": "noon"}],
        "In one word, please.",
    ),
    *CONVERSATION[3:],
]


@pytest.mark.parametrize(
    "tokenizer", list(templates()), ids=lambda t: "qwen" if "Qwen" in t.chat_template else "hermes"
)
def test_results_with_the_users_words_are_one_turn_cut_alone_as_the_whole_render(tokenizer):
    assert template_messages(WITH_TEXT)[4] == {"role": "user", "content": "In one word, please."}
    chat_format = ChatFormat(tokenizer, "Be brief.", tools=TOOLS)
    fed = [token for ids in chat_format.conversation_ids(WITH_TEXT) for token in ids]
    assert fed == whole_render(tokenizer, WITH_TEXT, "Be brief.")


def test_a_live_turn_of_results_and_words_feeds_the_whole_render_and_is_journaled(tmp_path):
    model, tokenizer = scripted_tool_model()
    session = session_under_test(model, tokenizer, SessionOptions(settings=GREEDY, window=400))
    list(session.restore(ConversationState([], None, GREEDY, tools=TOOLS)))
    list(session.driver.run(session.chat("Weather?")))
    call = {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    session.settle_tool_calls("", [call])
    results = [{"tool_call_id": "call_a", "content": "Error: no such city"}]
    finished = [
        e
        for e in session.driver.run(session.answer_tool_results(results, text="Try Lyon."))
        if isinstance(e, TurnFinished)
    ]
    assert len(finished) == 1  # one reply to both
    assert [message["role"] for message in session.transcript] == ["user", "assistant", "tool", "assistant"]
    assert session.transcript[2]["user_text"] == "Try Lyon."
    assert session.cache_view().token_ids == whole_render(tokenizer, session.transcript)

    journal = Journal(tmp_path, "tiny", {}, pytest.fail)
    journal.record(session.snapshot(tensors=False), "eos")
    saved = read_session(journal.path)
    assert saved.messages == session.transcript
    save_session(tmp_path / "saved.json", session.snapshot(tensors=False), "tiny")  # /save FILE's format too
    assert read_session(tmp_path / "saved.json").messages == session.transcript
    list(session.replay(saved.messages))  # replayed from the journal, the same tokens
    assert session.cache_view().token_ids == whole_render(tokenizer, session.transcript)
