from __future__ import annotations

import dataclasses

import pytest
from transformers import GenerationConfig

from streamchat import defaults
from streamchat.errors import ConfigError
from streamchat.generation.settings import MAX_SEED, GenerationSettings, parse_setting


def test_defaults_come_from_streamchat_defaults() -> None:
    settings = GenerationSettings()
    assert settings == GenerationSettings(
        max_new_tokens=defaults.MAX_NEW_TOKENS,
        temperature=defaults.TEMPERATURE,
        top_p=defaults.TOP_P,
        top_k=defaults.TOP_K,
        min_p=defaults.MIN_P,
        repetition_penalty=defaults.REPETITION_PENALTY,
        frequency_penalty=defaults.FREQUENCY_PENALTY,
        presence_penalty=defaults.PRESENCE_PENALTY,
        seed=None,
        stop=(),
    )
    assert not settings.greedy
    assert GenerationSettings(temperature=0).greedy
    assert (settings.frequency_penalty, settings.presence_penalty) == (0.0, 0.0)  # off


@pytest.mark.parametrize(
    ("frequency", "presence", "counts"),
    [(0, 0, False), (0.5, 0, True), (0, -0.5, True), (-2, 2, True)],
)
def test_the_reply_tokens_are_counted_only_when_a_penalty_reads_them(frequency, presence, counts) -> None:
    settings = GenerationSettings(frequency_penalty=frequency, presence_penalty=presence)
    assert settings.counts_reply_tokens is counts


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        GenerationSettings().temperature = 1.0  # type: ignore[misc]


def test_whole_numbers_are_accepted_for_number_settings() -> None:
    settings = GenerationSettings(temperature=1, top_p=1)
    assert (settings.temperature, settings.top_p) == (1.0, 1.0)
    assert isinstance(settings.temperature, float)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_new_tokens", 0, "max_new_tokens must be a whole number of at least 1, got 0."),
        ("max_new_tokens", 2.5, "max_new_tokens must be a whole number of at least 1, got 2.5."),
        ("temperature", -0.1, "temperature must be a number of at least 0 (0 = greedy), got -0.1."),
        ("temperature", float("nan"), "temperature must be a number of at least 0 (0 = greedy), got nan."),
        ("top_p", 0.0, "top_p must be a number above 0 and at most 1 (1 = off), got 0.0."),
        ("top_p", 1.5, "top_p must be a number above 0 and at most 1 (1 = off), got 1.5."),
        ("top_k", -1, "top_k must be a whole number of at least 0 (0 = off), got -1."),
        ("min_p", 1.01, "min_p must be a number from 0 to 1 (0 = off), got 1.01."),
        ("repetition_penalty", 0, "repetition_penalty must be a number above 0 (1 = off), got 0."),
        ("frequency_penalty", 3, "frequency_penalty must be a number from -2 to 2 (0 = off), got 3."),
        ("frequency_penalty", -2.5, "frequency_penalty must be a number from -2 to 2 (0 = off), got -2.5."),
        ("presence_penalty", float("nan"), "presence_penalty must be a number from -2 to 2 (0 = off), got nan."),
        ("presence_penalty", "0.5", "presence_penalty must be a number from -2 to 2 (0 = off), got '0.5'."),
        ("seed", -1, f"seed must be a whole number from 0 to {MAX_SEED}, or 'random', got -1."),
        (
            "seed",
            MAX_SEED + 1,
            f"seed must be a whole number from 0 to {MAX_SEED}, or 'random', got {MAX_SEED + 1}.",
        ),
        ("temperature", True, "temperature must be a number of at least 0 (0 = greedy), got True."),
        ("stop", ("",), "stop must be a tuple of non-empty strings, got ('',)."),
        ("stop", ["###"], "stop must be a tuple of non-empty strings, got ['###']."),
    ],
)
def test_bad_values_name_the_setting_the_value_and_the_range(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        GenerationSettings(**{field: value})
    assert str(caught.value) == message


def test_range_edges_are_accepted() -> None:
    GenerationSettings(max_new_tokens=1, temperature=0, top_p=1, top_k=0, min_p=1, seed=0)
    GenerationSettings(min_p=0, seed=MAX_SEED, repetition_penalty=0.5)
    GenerationSettings(frequency_penalty=-2, presence_penalty=2)
    GenerationSettings(frequency_penalty=2, presence_penalty=-2)


def test_without_generation_config_streamchat_defaults_apply() -> None:
    assert GenerationSettings.from_generation_config(None) == GenerationSettings()
    # transformers 5 leaves every field unset (None) unless the model's config sets it.
    assert GenerationSettings.from_generation_config(GenerationConfig()) == GenerationSettings()


def test_values_the_generation_config_sets_override_the_defaults() -> None:
    config = GenerationConfig(
        do_sample=True, temperature=0.6, top_p=0.8, top_k=20, max_new_tokens=100, repetition_penalty=1.05
    )
    assert GenerationSettings.from_generation_config(config) == GenerationSettings(
        temperature=0.6, top_p=0.8, top_k=20, max_new_tokens=100, repetition_penalty=1.05
    )
    # Only what it sets: min_p, seed and stop keep streamchat's values.
    assert GenerationSettings.from_generation_config(GenerationConfig(top_k=5)) == GenerationSettings(top_k=5)


def test_generation_config_without_sampling_means_greedy() -> None:
    settings = GenerationSettings.from_generation_config(GenerationConfig(do_sample=False, top_p=0.5))
    assert settings.greedy
    assert settings.temperature == 0.0
    assert settings.top_p == 0.5


def test_bad_generation_config_value_says_where_it_comes_from() -> None:
    config = GenerationConfig(top_k=5)
    config.top_k = -3
    with pytest.raises(ConfigError, match=r"^the model's generation config: top_k must be .*, got -3\.$"):
        GenerationSettings.from_generation_config(config)


@pytest.mark.parametrize(
    ("key", "text", "expected"),
    [
        ("max_new_tokens", "64", 64),
        ("temperature", "0.5", 0.5),
        ("temperature", " 0 ", 0.0),
        ("top_p", "1", 1.0),
        ("top_k", "40", 40),
        ("min_p", "0.05", 0.05),
        ("repetition_penalty", "1.1", 1.1),
        ("frequency_penalty", "0.5", 0.5),
        ("frequency_penalty", "-2", -2.0),
        ("presence_penalty", "1.25", 1.25),
        ("presence_penalty", "0", 0.0),
        ("seed", "1234", 1234),
        ("seed", "random", None),
        ("seed", "Random", None),
        ("stop", "###", ("###",)),
        ("stop", "'User:' '\n\n' ###", ("User:", "\n\n", "###")),
        ("stop", '"Human: " END', ("Human: ", "END")),
        ("stop", "none", ()),
        ("stop", "", ()),
    ],
)
def test_parse_setting_types_the_text_of_a_set_command(key: str, text: str, expected: object) -> None:
    changes = parse_setting(key, text)
    assert changes == {key: expected} and type(changes[key]) is type(expected)
    settings = GenerationSettings(seed=7, stop=("old",))
    changed = settings.changed(changes)
    assert getattr(changed, key) == expected
    assert dataclasses.replace(changed, **{key: getattr(settings, key)}) == settings  # nothing else changed


def test_parse_setting_rejects_unknown_keys_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_setting("temprature", "0.5")
    assert str(caught.value) == (
        "unknown setting 'temprature'; settings: max_new_tokens, temperature, top_p, top_k, min_p, "
        "repetition_penalty, frequency_penalty, presence_penalty, seed, stop."
    )


@pytest.mark.parametrize(
    ("key", "text", "message"),
    [
        ("temperature", "warm", "temperature must be a number of at least 0 (0 = greedy), got 'warm'."),
        ("temperature", "-1", "temperature must be a number of at least 0 (0 = greedy), got -1.0."),
        ("top_k", "2.5", "top_k must be a whole number of at least 0 (0 = off), got '2.5'."),
        ("frequency_penalty", "x", "frequency_penalty must be a number from -2 to 2 (0 = off), got 'x'."),
        ("frequency_penalty", "3", "frequency_penalty must be a number from -2 to 2 (0 = off), got 3.0."),
        ("presence_penalty", "nan", "presence_penalty must be a number from -2 to 2 (0 = off), got nan."),
        ("presence_penalty", "-2.01", "presence_penalty must be a number from -2 to 2 (0 = off), got -2.01."),
        ("max_new_tokens", "", "max_new_tokens must be a whole number of at least 1, got ''."),
        ("seed", "lucky", f"seed must be a whole number from 0 to {MAX_SEED}, or 'random', got 'lucky'."),
        (
            "stop",
            "'unclosed",
            "stop must be words separated by spaces (quote one that holds a space), or 'none', got \"'unclosed\".",
        ),
    ],
)
def test_parse_setting_rejects_bad_text_naming_key_and_value(key: str, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_setting(key, text)
    assert str(caught.value) == message


def test_pairs_list_every_setting_in_set_command_form() -> None:
    settings = GenerationSettings(temperature=0.5, seed=None, stop=("User:", "two words"), presence_penalty=-1.5)
    assert settings.as_pairs() == [
        ("max_new_tokens", str(defaults.MAX_NEW_TOKENS)),
        ("temperature", "0.5"),
        ("top_p", str(defaults.TOP_P)),
        ("top_k", str(defaults.TOP_K)),
        ("min_p", str(defaults.MIN_P)),
        ("repetition_penalty", str(defaults.REPETITION_PENALTY)),
        ("frequency_penalty", "0.0"),
        ("presence_penalty", "-1.5"),
        ("seed", "random"),
        ("stop", "User: 'two words'"),
    ]


@pytest.mark.parametrize(
    "settings",
    [
        GenerationSettings(),
        GenerationSettings(seed=42, stop=("a b", "\n", "it's"), temperature=0, top_k=3),
        GenerationSettings(frequency_penalty=-0.3, presence_penalty=1.7),
    ],
)
def test_pairs_round_trip_through_parse_setting(settings: GenerationSettings) -> None:
    for key, text in settings.as_pairs():
        assert getattr(settings, key) == parse_setting(key, text)[key]


def test_changed_validates_what_it_changes_and_keeps_the_rest() -> None:
    settings = GenerationSettings(seed=7)
    assert settings.changed({"temperature": 0.25, "stop": ("a b", "it's")}) == dataclasses.replace(
        settings, temperature=0.25, stop=("a b", "it's")
    )
    assert settings.changed({"top_k": 3}).top_k == 3 and settings.changed({}) == settings
    with pytest.raises(ConfigError, match=r"^top_p must be a number above 0 and at most 1 \(1 = off\), got 0.0.$"):
        settings.changed({"top_p": 0.0})


def test_changes_to_are_the_fields_that_differ_typed() -> None:
    settings = GenerationSettings(seed=7, stop=("x",))
    other = dataclasses.replace(settings, temperature=0.0, seed=None, stop=("a b",))
    assert settings.changes_to(other) == {"temperature": 0.0, "seed": None, "stop": ("a b",)}
    assert settings.changed(settings.changes_to(other)) == other
    assert settings.changes_to(settings) == {}
