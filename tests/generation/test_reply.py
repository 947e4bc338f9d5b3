"""A reply growing token by token: its text, stop strings that straddle tokens, its stats."""

import time

from streamchat.generation.reply import Reply
from streamchat.generation.settings import GenerationSettings
from tests.support.tokenizers import byte_level_tokenizer


def grow(text: str, stop: tuple[str, ...] = ()) -> tuple[Reply, list[str]]:
    """Feed `text` one byte-level token per character until the reply stops."""
    tokenizer = byte_level_tokenizer()
    started = time.perf_counter() - 1.0
    reply = Reply(tokenizer, GenerationSettings(max_new_tokens=100, stop=stop), started, prefilled=started + 0.25)
    shown = []
    for character in text:
        for token in tokenizer.encode(character, add_special_tokens=False):
            shown.append(reply.add(token))
        if reply.reason == "stop_string":
            break
    shown.append(reply.flush())
    return reply, shown


def test_without_stop_strings_every_token_shows_and_the_text_is_whole():
    reply, shown = grow("Hello, wörld")
    assert "".join(shown) == reply.text == "Hello, wörld"
    assert reply.reason == "max_new_tokens"


def test_a_stop_string_across_tokens_cuts_the_text_before_it():
    reply, shown = grow("one two END three", stop=("END",))
    assert reply.text == "".join(shown) == "one two "
    assert reply.reason == "stop_string"


def test_the_earliest_of_several_stop_strings_wins():
    reply, _ = grow("abc xyz def", stop=("def", " xy"))
    assert reply.text == "abc"


def test_stats_count_the_tokens_and_time_the_prompt_the_first_token_and_the_rest():
    reply, _ = grow("hello there")
    stats = reply.stats(prompt_tokens=7)
    assert stats.prompt_tokens == 7 and stats.generated_tokens == len(reply.ids) == 11
    assert stats.prefill_seconds == 0.25 and stats.time_to_first_token >= 1.0
    assert stats.decode_seconds >= 0 and stats.stop_reason == "max_new_tokens"


def test_text_that_may_begin_a_stop_string_waits_until_it_cannot():
    reply, shown = grow("xEN yEN", stop=("END",))
    assert shown == ["x", "", "", "EN ", "y", "", "", "EN"]  # " " rules out "END"; the reply end releases the rest
    assert reply.text == "xEN yEN" and reply.reason == "max_new_tokens"
