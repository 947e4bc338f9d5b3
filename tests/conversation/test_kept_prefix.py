"""--keep: which first tokens stay forever, in every chat format, and what a session does with them."""

import pytest

from streamchat.conversation.kept_prefix import kept_tokens, parse_keep, system_turn_length
from streamchat.conversation.session import SessionOptions
from streamchat.conversation.template import ChatFormat
from streamchat.errors import ConfigError
from streamchat.generation.settings import GenerationSettings
from tests.support.models import tiny_model
from tests.support.sessions import session_under_test
from tests.support.tokenizers import (
    byte_level_tokenizer,
    default_model_tokenizer_or_skip,
    plain_tokenizer,
    sentencepiece_tokenizer,
)

VOCAB = 700
SYSTEM = "You are terse. The secret word is pineapple."
GREEDY = GenerationSettings(max_new_tokens=12, temperature=0.0)


def kept_text(tokenizer, system_prompt):
    chat_format = ChatFormat(tokenizer, system_prompt=system_prompt)
    ids = chat_format.prompt_ids("Hello there", first_turn=True)
    return tokenizer.decode(ids[: system_turn_length(chat_format)], skip_special_tokens=False)


@pytest.mark.parametrize(
    ("tokenizer", "expected"),
    [
        (byte_level_tokenizer, f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"),  # ChatML
        (sentencepiece_tokenizer, f"<s>[INST] <<SYS>>\n{SYSTEM}\n<</SYS>>\n\n"),  # inside the first [INST]
        (plain_tokenizer, f"{SYSTEM}\n\n"),  # the USER:/ASSISTANT: fallback
    ],
)
def test_the_system_turn_ends_where_the_user_turn_begins_in_every_format(tokenizer, expected):
    assert kept_text(tokenizer(), SYSTEM) == expected


@pytest.mark.parametrize("tokenizer", [byte_level_tokenizer, sentencepiece_tokenizer, plain_tokenizer])
def test_without_a_system_prompt_there_is_no_system_turn(tokenizer):
    assert system_turn_length(ChatFormat(tokenizer())) == 0


def test_the_default_model_s_own_default_system_prompt_is_kept():
    tokenizer = default_model_tokenizer_or_skip()
    expected = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    assert kept_text(tokenizer, None) == expected
    assert system_turn_length(ChatFormat(tokenizer)) == 21


def test_keep_system_never_keeps_fewer_than_the_paper_s_four():
    assert kept_tokens(ChatFormat(byte_level_tokenizer()), "system", 100) == 4
    assert kept_tokens(ChatFormat(byte_level_tokenizer(), system_prompt=SYSTEM), "system", 100) == 30
    assert kept_tokens(ChatFormat(byte_level_tokenizer(), system_prompt=SYSTEM), 4, 100) == 4
    assert kept_tokens(ChatFormat(byte_level_tokenizer()), 0, 100) == 0


def test_a_kept_prefix_longer_than_the_window_is_refused_with_its_length():
    chat_format = ChatFormat(byte_level_tokenizer(), system_prompt=SYSTEM)
    message = "the system turn is 30 tokens, longer than the 29-token window: shorten the system prompt, raise"
    with pytest.raises(ConfigError, match=f"^{message}"):
        kept_tokens(chat_format, "system", 29)
    assert kept_tokens(chat_format, "system", 30) == 30
    with pytest.raises(ConfigError, match=r"^--keep 31 is more than the 30-token window; keep at most 30$"):
        kept_tokens(chat_format, 31, 30)


@pytest.mark.parametrize(("raw", "keep"), [("system", "system"), ("4", 4), (" 60 ", 60), (0, 0), (12, 12)])
def test_keep_is_system_or_a_number(raw, keep):
    assert parse_keep(raw) == keep


@pytest.mark.parametrize("raw", ["System", "-1", -1, "four", True, 2.5, ""])
def test_other_keeps_are_refused(raw):
    with pytest.raises(ConfigError, match=r"^keep must be 'system' or a whole number of first tokens >= 0, got"):
        parse_keep(raw)


def make_session(**options):
    options.setdefault("window", 40)
    options.setdefault("settings", GREEDY)
    return session_under_test(tiny_model("llama", vocab_size=VOCAB), byte_level_tokenizer(), SessionOptions(**options))


def chat(session, text):
    return list(session.chat(text))


def test_the_system_turn_stays_in_the_cache_while_the_conversation_scrolls_past_it():
    pinned, plain = make_session(system_prompt=SYSTEM), make_session(system_prompt=SYSTEM, keep=4)
    for session in (pinned, plain):
        for turn in range(5):
            chat(session, f"Turn {turn}: tell me something.")
        assert session.cache_stats().evicted > 100
    decode = byte_level_tokenizer().decode
    assert decode(pinned.cache_view().sink_ids) == f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    assert pinned.cache_stats().sink_capacity == pinned.cache_stats().sinks_held == 30
    assert pinned.cache.capacity == 30 + 40
    assert decode(plain.cache_view().sink_ids) == "<|im_start|>system\nY"  # the paper's 4 first tokens
    assert plain.cache.capacity == 4 + 40


def test_a_new_system_prompt_of_another_length_gets_a_new_cache_and_a_replay():
    session = make_session(system_prompt=SYSTEM)
    chat(session, "Hello!")
    first_cache = session.cache
    list(session.set_system_prompt("Be brief."))
    assert session.cache is not first_cache and session.cache.sinks == 13
    assert byte_level_tokenizer().decode(session.cache_view().sink_ids) == "<|im_start|>system\nBe brief.<|im_end|>\n"
    assert [m["role"] for m in session.transcript] == ["user", "assistant"]
    chat(session, "And now?")
    cache = session.cache
    list(session.set_system_prompt("Be brief."))  # as many tokens to keep: the same cache, replayed
    assert session.cache is cache and session.cache_stats().seen > 13


def test_a_system_prompt_too_long_to_keep_changes_nothing():
    session = make_session(system_prompt=SYSTEM)
    chat(session, "Hello!")
    cache, cached = session.cache, session.cache_view().token_ids
    with pytest.raises(ConfigError, match=r"^the system turn is \d+ tokens, longer than the 40-token window"):
        session.set_system_prompt("Be terse. " * 30)
    assert session.cache is cache and session.cache_view().token_ids == cached and session.system_prompt == SYSTEM
    with pytest.raises(ConfigError, match=r"the system turn is \d+ tokens"):
        make_session(system_prompt="Be terse. " * 30)
