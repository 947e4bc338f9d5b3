"""ChatSession on a tiny random llama and an offline ChatML tokenizer: real forward passes, real cache."""

import dataclasses
import json

import pytest
import torch

from streamchat.conversation.session import SessionOptions
from streamchat.errors import ChatTemplateError, ConfigError, OutOfMemoryError
from streamchat.generation.events import CacheOccupancy, Evicted, PromptTruncated, Replayed, TextDelta, TurnFinished
from streamchat.generation.settings import GenerationSettings
from tests.support.models import tiny_model
from tests.support.sessions import session_under_test
from tests.support.tokenizers import CHATML_TEMPLATE, byte_level_tokenizer, byte_level_tokenizer_with, plain_tokenizer

VOCAB = 700  # covers the offline tokenizers (600 tokens)
GREEDY = GenerationSettings(max_new_tokens=8, temperature=0.0)
NO_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}" + CHATML_TEMPLATE
)


def make_session(tokenizer=None, settings=GREEDY, model=None, **options):
    model = model or tiny_model("llama", vocab_size=VOCAB)
    options.setdefault("window", 400)
    return session_under_test(model, tokenizer or byte_level_tokenizer(), SessionOptions(settings=settings, **options))


def run(events):
    events = list(events)
    assert isinstance(events[-1], (TurnFinished, Replayed))
    return events


def reply_of(events) -> str:
    return "".join(event.text for event in events if isinstance(event, TextDelta))


def whole_render(tokenizer, messages, system_prompt=None):
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return tokenizer.apply_chat_template(system + messages, tokenize=True, return_dict=False)


def test_a_turn_streams_a_reply_and_records_it():
    session = make_session()
    events = run(session.chat("Hello! How are you today?"))
    finished = events[-1]
    assert reply_of(events) == finished.reply == session.transcript[1]["content"]
    assert session.transcript[0] == {"role": "user", "content": "Hello! How are you today?"}
    assert finished.stats.generated_tokens == 8 and finished.stats.stop_reason == "max_new_tokens"
    assert isinstance(events[-2], CacheOccupancy)


@pytest.mark.parametrize("system_prompt", [None, "You are terse."])
def test_turn_by_turn_feeding_equals_the_whole_conversation_rendered_at_once(system_prompt):
    tokenizer = byte_level_tokenizer()
    session = make_session(system_prompt=system_prompt)
    eot = list(session.chat_format.end_of_turn_ids)
    before = []
    for turn, text in enumerate(["Hello!", "What is the capital of France?", "Thank you."]):
        finished = run(session.chat(text))[-1]
        added = session.cache_view().token_ids[len(before) :]
        # Each turn feeds its prompt, the generated reply and the end of turn, and nothing else.
        prompt = session.chat_format.prompt_ids(text, first_turn=turn == 0)
        assert added[: len(prompt)] == prompt and added[len(prompt) :][-len(eot) :] == eot
        assert len(added) == len(prompt) + finished.stats.generated_tokens + len(eot)
        before = session.cache_view().token_ids
    # With replies as the tokenizer writes them in the render, the stream is the whole render.
    run(session.replay(list(session.transcript)))
    assert session.cache_view().token_ids == whole_render(tokenizer, session.transcript, system_prompt)


def test_models_without_a_template_get_the_user_assistant_fallback():
    tokenizer = plain_tokenizer()
    session = make_session(tokenizer=tokenizer)
    run(session.chat("Hi there"))
    run(session.replay(list(session.transcript)))
    text = tokenizer.decode(session.cache_view().token_ids)
    assert text.startswith("USER: Hi there\n\nASSISTANT:")


def test_the_end_of_turn_enters_the_cache_after_every_reply():
    session = make_session()
    run(session.chat("Hello!"))
    tail = session.cache_view().token_ids[-len(session.chat_format.end_of_turn_ids) :]
    assert tuple(tail) == session.chat_format.end_of_turn_ids
    assert byte_level_tokenizer().decode(tail) == "<|im_end|>\n"


def test_a_stop_token_from_the_generation_config_ends_the_reply():
    model = tiny_model("llama", vocab_size=VOCAB)
    first = make_session(model=model)
    run(first.chat("Hello!"))
    generated = first.cache_view().token_ids[-(8 + 2) : -2]
    model.generation_config.eos_token_id = [2, generated[3]]
    try:
        session = make_session(model=model)
        events = run(session.chat("Hello!"))
    finally:
        model.generation_config.eos_token_id = 2
    assert events[-1].stats.stop_reason == "eos"
    assert events[-1].stats.generated_tokens == 3
    # The stop token itself is not fed: the template's end of turn is.
    assert session.cache_view().token_ids[-5:] == generated[:3] + list(session.chat_format.end_of_turn_ids)


def test_stop_strings_cut_the_reply():
    session = make_session()
    reply = events_reply = reply_of(run(session.chat("Hello!")))
    stop = reply[3:5]
    assert stop.strip(), "the greedy reply should have text to stop on"
    session = make_session(settings=GenerationSettings(max_new_tokens=8, temperature=0.0, stop=(stop,)))
    events = run(session.chat("Hello!"))
    assert reply_of(events) == events[-1].reply == events_reply[: reply.index(stop)]
    assert events[-1].stats.stop_reason == "stop_string"


def test_a_stopped_reply_is_closed_and_the_next_turn_works():
    session = make_session(settings=GenerationSettings(max_new_tokens=50, temperature=0.0))
    events = []
    for event in session.chat("Hello!"):
        events.append(event)
        if sum(isinstance(e, TextDelta) for e in events) == 3:
            session.stop()
    finished = events[-1]
    assert finished.stats.stop_reason == "interrupted"
    assert finished.reply == reply_of(events) == session.transcript[-1]["content"]
    assert finished.stats.generated_tokens < 50
    eot = list(session.chat_format.end_of_turn_ids)
    assert session.cache_view().token_ids[-len(eot) :] == eot
    later = run(session.chat("Are you there?"))
    assert later[-1].stats.generated_tokens == 50
    assert [m["role"] for m in session.transcript] == ["user", "assistant", "user", "assistant"]


def test_an_abandoned_reply_is_closed_too():
    session = make_session(settings=GenerationSettings(max_new_tokens=50, temperature=0.0))
    turn = session.chat("Hello!")
    shown = ""
    for event in turn:
        if isinstance(event, TextDelta):
            shown += event.text
            break
    turn.close()
    assert session.transcript[-1]["content"].startswith(shown)
    eot = list(session.chat_format.end_of_turn_ids)
    assert session.cache_view().token_ids[-len(eot) :] == eot
    assert run(session.chat("Next"))[-1].stats.stop_reason == "max_new_tokens"


def test_a_reply_abandoned_at_an_eviction_keeps_every_sampled_token():
    session = make_session(settings=GenerationSettings(max_new_tokens=50, temperature=0.0), keep=4, window=30)
    sampled = []
    decoder = session.token_loop.decoder
    fed = decoder.fed  # each step's token, settled after the step fed it
    decoder.fed = lambda logits: sampled.append(fed(logits)) or sampled[-1]
    prompt = session.chat_format.prompt_ids("Hello!", first_turn=True)
    turn = session.chat("Hello!")
    for event in turn:
        if isinstance(event, Evicted) and len(sampled) > 3:
            break  # the eviction that made room for the latest sampled token
    turn.close()
    eot = list(session.chat_format.end_of_turn_ids)
    assert session.cache_view().token_ids[-len(eot) - 1 :] == [sampled[-1], *eot]
    assert session.cache_stats().seen == len(prompt) + len(sampled) + len(eot)


def test_a_reply_abandoned_after_the_conversation_was_replaced_stays_abandoned():
    session = make_session(settings=GenerationSettings(max_new_tokens=50, temperature=0.0))
    turn = session.chat("Hello!")
    next(event for event in turn if isinstance(event, TextDelta))
    run(session.recover())  # a second Ctrl-C: the half-done turn is dropped
    turn.close()
    assert session.transcript == [] and session.cache_stats().seen == 0
    assert run(session.chat("Hello!"))[-1].stats.generated_tokens == 50


def test_the_same_seed_gives_the_same_conversation():
    sampling = GenerationSettings(max_new_tokens=12, temperature=1.0, seed=1234)

    def replies(settings):
        session = make_session(settings=settings)
        return [run(session.chat(text))[-1].reply for text in ("Hello!", "Tell me more.")]

    assert replies(sampling) == replies(sampling)
    other = GenerationSettings(max_new_tokens=12, temperature=1.0, seed=99)
    assert replies(other) != replies(sampling)


def test_turn_stats_are_plausible():
    session = make_session()
    prompt = session.chat_format.prompt_ids("What is the capital of France?", first_turn=True)
    stats = run(session.chat("What is the capital of France?"))[-1].stats
    assert stats.prompt_tokens == len(prompt)
    assert stats.generated_tokens == 8
    assert 0 < stats.prefill_seconds < stats.time_to_first_token
    assert stats.prefill_tokens_per_second > 0 and stats.decode_tokens_per_second > 0


def test_replies_keep_streaming_past_a_full_window():
    session = make_session(settings=GenerationSettings(max_new_tokens=120, temperature=0.0), keep=4, window=40)
    events = run(session.chat("Hello!"))
    evictions = [event for event in events if isinstance(event, Evicted)]
    assert events[-1].stats.generated_tokens == 120
    assert sum(e.count for e in evictions) == session.cache_stats().evicted > 80
    first_text = next(i for i, e in enumerate(events) if isinstance(e, TextDelta))
    assert any(isinstance(e, Evicted) for e in events[first_text:])  # evictions happen mid-reply
    assert all(e.stats.used <= 44 for e in events if isinstance(e, (Evicted, CacheOccupancy)))


def test_the_per_turn_policy_reserves_room_before_the_reply():
    settings = GenerationSettings(max_new_tokens=10, temperature=0.0)
    session = make_session(settings=settings, keep=4, window=40, eviction="turn")
    run(session.chat("Hello! How are you today?"))
    events = run(session.chat("Tell me more."))
    first_text = next(i for i, e in enumerate(events) if isinstance(e, TextDelta))
    assert [e for e in events[:first_text] if isinstance(e, Evicted)]
    assert not [e for e in events[first_text:] if isinstance(e, Evicted)]


def test_a_prompt_longer_than_the_window_is_fed_in_chunks_and_reported():
    session = make_session(keep=4, window=40, prefill_chunk=16)
    long_text = "The quick brown fox jumps over the lazy dog. " * 12
    events = run(session.chat(long_text))
    truncated = next(e for e in events if isinstance(e, PromptTruncated))
    prompt = session.chat_format.prompt_ids(long_text, first_turn=True)
    # The first turn's first tokens are the sinks: the model sees them and the last 40.
    assert (truncated.prompt_tokens, truncated.visible_tokens) == (len(prompt), 44)
    events = run(session.chat(long_text))
    truncated = next(e for e in events if isinstance(e, PromptTruncated))
    prompt = session.chat_format.prompt_ids(long_text, first_turn=False)
    assert (truncated.prompt_tokens, truncated.visible_tokens) == (len(prompt), 40)


def test_a_prompt_that_just_fits_the_sinks_and_the_window_is_not_truncated():
    text = "Tell me about the sea and the sky."
    length = len(make_session().chat_format.prompt_ids(text, first_turn=True))
    fits = run(make_session(keep=4, window=length - 4).chat(text))
    assert not any(isinstance(e, PromptTruncated) for e in fits)
    one_over = run(make_session(keep=4, window=length - 5).chat(text))
    assert [e.dropped_tokens for e in one_over if isinstance(e, PromptTruncated)] == [1]


def test_two_hundred_turns_through_a_small_cache_stay_bounded():
    session = make_session(settings=GenerationSettings(max_new_tokens=6, temperature=0.0), keep=4, window=252)
    storage = None
    for turn in range(200):
        events = run(session.chat(f"Turn {turn}: tell me something."))
        assert events[-1].stats.generated_tokens == 6
        storage = storage or [layer.keys.data_ptr() for layer in session.cache.layers]
    stats = session.cache_stats()
    assert stats.used == 256 and stats.evicted == stats.seen - 256
    assert [layer.keys.data_ptr() for layer in session.cache.layers] == storage
    assert len(session.cache_view().token_ids) == 256
    assert len(session.transcript) == 400


def test_regenerate_replaces_the_last_reply_from_the_same_prompt():
    session = make_session()
    first = run(session.chat("Hello!"))[-1].reply
    seen = session.cache_stats().seen
    again = run(session.regenerate())
    assert again[-1].reply == first  # greedy: the same reply from the same cache
    assert session.cache_stats().seen == seen
    assert [m["role"] for m in session.transcript] == ["user", "assistant"]


def test_regenerate_with_frequency_and_presence_penalties_counts_the_new_reply_from_zero():
    session = make_session(settings=GenerationSettings(max_new_tokens=24, temperature=0.0))
    plain = run(session.chat("Hello!"))[-1].reply
    session.update_settings(frequency_penalty=0.5, presence_penalty=1.5)
    assert (session.settings.frequency_penalty, session.settings.presence_penalty) == (0.5, 1.5)
    penalized = run(session.regenerate())[-1].reply
    assert penalized != plain  # the penalties change the reply
    # Greedy: the same reply again, so nothing of the last one was counted against it.
    assert run(session.regenerate())[-1].reply == penalized
    state = session.snapshot()
    assert (state.settings.frequency_penalty, state.settings.presence_penalty) == (0.5, 1.5)


def test_regenerate_tells_the_same_story_of_the_cache_as_the_reply_it_replaces():
    # Greedy: the same reply again. It evicts as it goes (a window of 40), and /regen takes those evictions back.
    session = make_session(keep=4, window=40, settings=dataclasses.replace(GREEDY, max_new_tokens=30))
    run(session.chat("Hello! How are you today?"))
    events = run(session.chat("Tell me more."))
    first, evicted = session.cache_view(), [event.text for event in events if isinstance(event, Evicted)]
    assert first.forgotten_tokens > 0 and evicted
    again = run(session.regenerate())
    assert session.cache_view() == first
    evicted_again = [event.text for event in again if isinstance(event, Evicted)]
    assert evicted_again and evicted_again == evicted[-len(evicted_again) :]  # the reply's own, token by token


def test_a_session_that_does_not_regenerate_keeps_no_copy_of_its_cache_for_it():
    """A server's sessions: no /regen point after a prompt, so nothing holds the cache's rebase back either."""
    kept, unkept = make_session(), make_session(regenerates=False)
    assert reply_of(run(kept.chat("Hello"))) == reply_of(run(unkept.chat("Hello")))
    assert kept.cache.ledger.rebase_held and not unkept.cache.ledger.rebase_held
    with pytest.raises(ConfigError, match="no reply to regenerate"):
        list(unkept.regenerate())


def test_regenerate_without_a_reply_is_refused():
    with pytest.raises(ConfigError, match="no reply to regenerate"):
        list(make_session().regenerate())


def test_a_snapshot_restored_without_tensors_replays_the_transcript():
    session = make_session(system_prompt="Be kind.")
    run(session.chat("Hello!"))
    session.update_settings(temperature=0.5)
    state = session.snapshot(tensors=False)
    assert state.messages == session.transcript and state.system_prompt == "Be kind." and state.tensors is None
    assert state.settings.temperature == 0.5 and state.eviction == "token"

    restored = make_session()
    events = run(restored.restore(state))
    assert events[-1] == Replayed(messages=2, tokens=restored.cache_stats().seen)
    assert restored.transcript == session.transcript
    assert restored.system_prompt == "Be kind." and restored.settings.temperature == 0.5
    assert restored.cache_view().token_ids == whole_render(byte_level_tokenizer(), session.transcript, "Be kind.")
    assert run(restored.chat("And now?"))[-1].stats.generated_tokens == 8


def test_a_snapshot_is_a_value_the_session_does_not_change_later():
    session = make_session()
    run(session.chat("Hello!"))
    state = session.snapshot()
    run(session.chat("And now?"))
    assert len(state.messages) == 2 and len(session.transcript) == 4
    assert state.tensors.tensors["mirror.window"].shape[0] < session.cache_stats().window_used


def test_a_replay_feeds_only_the_sinks_and_the_last_two_windows():
    session = make_session(keep=4, window=40)
    for turn in range(6):
        run(session.chat(f"Turn {turn}: tell me something."))
    whole = whole_render(byte_level_tokenizer(), session.transcript)
    assert len(whole) > 4 + 2 * 40
    streamed = session.cache_view()
    replayed = run(session.replay(list(session.transcript)))[-1]
    assert replayed == Replayed(messages=12, tokens=4 + 2 * 40)
    assert session.cache_view().token_ids == whole[:4] + whole[-40:]
    assert session.cache_view() == streamed  # the same tokens, and the same story of what was forgotten
    assert run(session.chat("And now?"))[-1].stats.generated_tokens == 8


def test_a_state_with_a_bad_eviction_changes_nothing():
    session = make_session()
    run(session.chat("Hello!"))
    before = session.snapshot(tensors=False)
    other = make_session(system_prompt="Be brief.").snapshot()
    with pytest.raises(ConfigError, match="eviction"):
        session.restore(dataclasses.replace(other, settings=GenerationSettings(temperature=1.5), eviction="sometimes"))
    assert session.snapshot(tensors=False) == before


def test_a_system_prompt_the_template_refuses_changes_nothing():
    session = make_session(tokenizer=byte_level_tokenizer_with(NO_SYSTEM_TEMPLATE))
    run(session.chat("Hello!"))
    before, cached = list(session.transcript), session.cache_view().token_ids
    with pytest.raises(ChatTemplateError, match="may not accept a system prompt"):
        list(session.set_system_prompt("Be a pirate."))
    with pytest.raises(ChatTemplateError):
        session.restore(make_session(system_prompt="Be a pirate.").snapshot())
    assert session.system_prompt is None and session.transcript == before
    assert session.cache_view().token_ids == cached


def test_a_new_system_prompt_replays_the_conversation_behind_it():
    session = make_session()
    run(session.chat("Hello!"))
    run(session.set_system_prompt("You are a pirate."))
    assert session.system_prompt == "You are a pirate."
    expected = whole_render(byte_level_tokenizer(), session.transcript, "You are a pirate.")
    assert session.cache_view().token_ids == expected


def test_reset_forgets_the_conversation():
    session = make_session()
    run(session.chat("Hello!"))
    session.reset()
    assert session.transcript == [] and session.cache_stats().seen == 0
    run(session.chat("Hello!"))
    assert session.cache_stats().seen > 0


def test_settings_change_by_name_typed_and_a_bad_one_changes_nothing():
    session = make_session()
    session.update_settings(eviction="turn", top_k=5, stop=("a b", "it's"))
    assert ("eviction", "turn") in session.options() and ("top_k", "5") in session.options()
    assert session.settings.stop == ("a b", "it's")
    before = (session.settings, session.eviction)
    with pytest.raises(ConfigError, match="eviction must be one of token, turn"):
        session.update_settings(top_k=7, eviction="sometimes")
    with pytest.raises(ConfigError, match=r"^temperature must be a number of at least 0 \(0 = greedy\), got -1.0.$"):
        session.update_settings(top_k=7, temperature=-1.0)
    assert (session.settings, session.eviction) == before


def test_a_seed_given_starts_the_sampler_again_even_the_same_one():
    session = make_session(settings=GenerationSettings(max_new_tokens=8, temperature=1.0, seed=3))
    first = run(session.chat("Hello!"))[-1].reply
    session.reset()
    session.update_settings(seed=3)  # as `/set seed 3` typed again
    assert run(session.chat("Hello!"))[-1].reply == first
    session.reset()
    session.update_settings(top_k=0)  # no seed given: the sampler goes on where it was
    assert session.seed == 3


def test_the_cache_view_names_what_was_forgotten():
    session = make_session(settings=GenerationSettings(max_new_tokens=30, temperature=0.0), keep=4, window=40)
    for text in ("Hello!", "Tell me more.", "And more."):
        run(session.chat(text))
    view = session.cache_view()
    assert len(view.sink_ids) == 4 and len(view.window_ids) == 40
    assert view.forgotten_tokens == session.cache_stats().evicted
    assert view.forgotten_messages >= 2
    assert torch.tensor(view.window_ids).tolist() == session.cache_view().token_ids[4:]


def test_running_out_of_memory_half_way_through_the_layers_is_a_domain_error_and_the_session_recovers():
    session = make_session()
    run(session.chat("Hello!"))
    layer = session.model.model.layers[1]
    forward = layer.forward

    def exhausted(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    layer.forward = exhausted
    try:
        with pytest.raises(OutOfMemoryError, match=r"out of memory on cpu while reading .* smaller --window"):
            list(session.chat("More please"))
    finally:
        layer.forward = forward
    assert not session.cache.is_consistent()  # layer 0 stored the prompt, layer 1 did not
    run(session.recover())
    assert session.cache.is_consistent()
    assert [m["role"] for m in session.transcript] == ["user", "assistant"]
    assert session.cache_view().token_ids == whole_render(byte_level_tokenizer(), session.transcript)
    assert run(session.chat("More please"))[-1].stats.generated_tokens == 8


CHOICE = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["left", "right"]}},
    "required": ["ok", "pick"],
    "additionalProperties": False,
}


def test_a_session_held_to_a_schema_answers_each_turn_with_one_value_and_ends_it_there():
    from streamchat.generation.constraint import JsonFormat

    session = make_session(settings=dataclasses.replace(GREEDY, max_new_tokens=40), reply_format=JsonFormat(CHOICE))
    for text in ["Left or right?", "And now?"]:
        finished = run(session.chat(text))[-1]
        value = json.loads(finished.reply)
        assert set(value) == {"ok", "pick"} and value["pick"] in ("left", "right")
        assert finished.stats.stop_reason == "eos"
    session.reply_format = None  # free text again: the random model does not stop by itself
    assert run(session.chat("Say anything."))[-1].stats.stop_reason == "max_new_tokens"
