from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from transformers import GenerationConfig, PreTrainedTokenizerBase

from streamchat.conversation.kept_prefix import system_turn_length
from streamchat.conversation.template import ChatFormat, chat_format_for, fallback_template, stop_token_ids
from streamchat.errors import ChatTemplateError, UnsupportedModelError
from tests.support.tokenizers import (
    byte_level_tokenizer,
    default_model_tokenizer_or_skip,
    plain_tokenizer,
    sentencepiece_tokenizer,
)

TEMPLATE_DIR = Path(__file__).parents[2] / ".." / "shared" / "data" / "chat_templates"
TEMPLATE_FILES = sorted(TEMPLATE_DIR.glob("*.jinja"))

SYSTEM = "You are terse."
# Replies start and end with letters, digits, CJK, emoji and punctuation, since each
# meets the template text around it differently; no message starts or ends with
# whitespace (templates that trim would render it differently from the model's tokens).
TURNS = (
    ("Hi there!", "Hello! How can I help?"),
    ("What is 2+2?", "4, of course."),
    ("Tell me about 東京 🍣 please", "東京 is big 🗼"),
    ("Thanks.\nBye", "🙂 Bye!"),
)

TOKENIZERS = {"byte_level": byte_level_tokenizer, "sentencepiece": sentencepiece_tokenizer}


def compact(template: str) -> str:
    """A collection template as its README (chujiezheng/chat_templates) says to use it:
    indentation and line breaks removed. Raw, it writes blank lines around every message."""
    return template.replace("    ", "").replace("\n", "")


def shared_templates() -> list[Any]:
    if not TEMPLATE_FILES:
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"no templates in {TEMPLATE_DIR}"))]
    cases = []
    for path in TEMPLATE_FILES:
        template = path.read_text()
        cases.append(pytest.param(template, id=f"{path.stem}-raw"))
        if "{%-" not in template:  # templates with whitespace control need no compacting
            cases.append(pytest.param(compact(template), id=f"{path.stem}-compact"))
    return cases


def shared_template(name: str) -> str:
    path = TEMPLATE_DIR / f"{name}.jinja"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return compact(path.read_text())


def common_prefix_length(first: list[int], second: list[int]) -> int:
    length = 0
    while length < min(len(first), len(second)) and first[length] == second[length]:
        length += 1
    return length


def assert_turns_add_up_to_whole_render(
    tokenizer: PreTrainedTokenizerBase,
    template: str | None,
    system: str | None,
    turns: tuple[tuple[str, str], ...] = TURNS,
) -> None:
    """Feed `turns` one at a time as the engine does, and compare with the whole conversation."""
    chat = ChatFormat(tokenizer, system, chat_template=template)
    messages = [{"role": "system", "content": system}] if system else []
    for user, reply in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    reference = fallback_template(tokenizer) if chat.uses_fallback else template
    text = tokenizer.apply_chat_template(messages, chat_template=reference, tokenize=False)
    whole = tokenizer.apply_chat_template(messages, chat_template=reference, return_dict=False)

    stream: list[int] = []
    reply_end = 0
    for index, (user, reply) in enumerate(turns):
        stream += chat.prompt_ids(user, first_turn=index == 0)
        assert stream == whole[: len(stream)], f"prompt of turn {index + 1}"
        # What the model generates: the whole render's tokens up to the end of the reply.
        reply_end = text.index(reply, reply_end) + len(reply)
        up_to_reply_end = common_prefix_length(tokenizer.encode(text[:reply_end], add_special_tokens=False), whole)
        reply_ids = whole[len(stream) : up_to_reply_end]
        assert tokenizer.decode(reply_ids).strip() == reply
        stream += reply_ids + list(chat.end_of_turn_ids)
        assert stream == whole[: len(stream)], f"end of turn {index + 1}"
    # Left over: whitespace that ends the render, which the next turn's prompt starts
    # with but tokenizes differently ("\n\n" at the very end is one token, before a word two).
    rest = whole[len(stream) :]
    assert tokenizer.decode(rest, skip_special_tokens=False).strip() == ""


@pytest.mark.parametrize("system", [None, SYSTEM], ids=["no-system", "system"])
@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
@pytest.mark.parametrize("template", shared_templates())
def test_turns_add_up_to_whole_render_for_every_shared_template(
    template: str, tokenizer_name: str, system: str | None
) -> None:
    assert_turns_add_up_to_whole_render(TOKENIZERS[tokenizer_name](), template, system)


@pytest.mark.parametrize("system", [None, SYSTEM], ids=["no-system", "system"])
@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_turns_add_up_to_whole_render_with_own_template(tokenizer_name: str, system: str | None) -> None:
    assert_turns_add_up_to_whole_render(TOKENIZERS[tokenizer_name](), None, system)


@pytest.mark.parametrize("system", [None, SYSTEM], ids=["no-system", "system"])
@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_turns_add_up_to_whole_render_with_fallback_format(tokenizer_name: str, system: str | None) -> None:
    tokenizer = TOKENIZERS[tokenizer_name]()
    assert_turns_add_up_to_whole_render(tokenizer, fallback_template(tokenizer), system)


# Messages longer than ChatFormat probes whole (a pasted log): only their end meets the reply.
LONG_TURNS = (
    ("Summarise: " + "The quick brown fox jumps over the lazy dog. " * 120 + "Thanks!", "A fox jumps."),
    ("x" * 6000, "42"),
    ("東京 " * 2000 + "🍣", "東京 🗼"),
)


@pytest.mark.parametrize("system", [None, SYSTEM], ids=["no-system", "system"])
@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_long_messages_add_up_to_whole_render_too(tokenizer_name: str, system: str | None) -> None:
    assert_turns_add_up_to_whole_render(TOKENIZERS[tokenizer_name](), None, system, LONG_TURNS)


@pytest.mark.default_model
def test_default_model_long_messages_add_up_to_whole_render() -> None:
    assert_turns_add_up_to_whole_render(default_model_tokenizer_or_skip(), None, None, LONG_TURNS)


@pytest.mark.parametrize("system", [None, SYSTEM], ids=["no-system", "system"])
def test_model_without_template_gets_the_fallback_format(system: str | None) -> None:
    assert ChatFormat(plain_tokenizer()).uses_fallback
    assert_turns_add_up_to_whole_render(plain_tokenizer(), None, system)


def test_chatml_turns_are_the_template_pieces() -> None:
    tokenizer = byte_level_tokenizer()
    chat = ChatFormat(tokenizer, "Be brief.")
    assert tokenizer.decode(chat.prompt_ids("What?", first_turn=True)) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.decode(chat.prompt_ids("Why?", first_turn=False)) == (
        "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.end_of_turn_ids == tuple(tokenizer.encode("<|im_end|>\n"))
    assert not chat.uses_fallback


def test_trailing_space_of_the_prompt_moves_into_the_reply() -> None:
    # "ASSISTANT: Hello" tokenizes as ":", " Hello": a prompt ending in " " would feed a
    # lone space token the model never saw before a reply.
    tokenizer = plain_tokenizer()
    chat = ChatFormat(tokenizer)
    prompt = chat.prompt_ids("What?", first_turn=True)
    assert tokenizer.decode(prompt) == "USER: What?\n\nASSISTANT:"
    assert chat.uses_fallback


def test_fallback_format_renders_system_prompt_turns_and_eos() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    plain = plain_tokenizer()
    assert plain.apply_chat_template(messages, chat_template=fallback_template(plain), tokenize=False) == (
        "Be brief.\n\nUSER: Hi\n\nASSISTANT: Hello</s>\n\n"
    )
    # A tokenizer that adds BOS to every text gets it once, at the start.
    sentencepiece = sentencepiece_tokenizer()
    rendered = sentencepiece.apply_chat_template(
        messages[1:],
        chat_template=fallback_template(sentencepiece),
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered == "<s>USER: Hi\n\nASSISTANT: Hello</s>\n\nASSISTANT: "


def test_llama2_system_prompt_is_only_in_the_first_turn() -> None:
    tokenizer = sentencepiece_tokenizer()
    chat = ChatFormat(tokenizer, "Be brief.")
    first = tokenizer.decode(chat.prompt_ids("What?", first_turn=True))
    assert first == "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nWhat? [/INST]"
    assert tokenizer.decode(chat.prompt_ids("Why?", first_turn=False)) == "<s>[INST] Why? [/INST]"
    assert tokenizer.convert_ids_to_tokens(list(chat.end_of_turn_ids)) == ["▁", "</s>"]


def test_later_turns_get_no_sentencepiece_prefix_space() -> None:
    # After "</s>" the turn text is not the start of the text, so SentencePiece adds no
    # "▁"; tokenizing the turn's text on its own would.
    tokenizer = sentencepiece_tokenizer()
    chat = ChatFormat(tokenizer, chat_template=shared_template("mistral-instruct"))
    turn = chat.prompt_ids("Why?", first_turn=False)
    alone = tokenizer.encode("[INST] Why? [/INST]", add_special_tokens=False)
    assert tokenizer.decode(turn) == "[INST] Why? [/INST]"
    assert alone[0] == tokenizer.convert_tokens_to_ids("▁")
    assert turn == alone[1:]


def test_template_refusing_system_prompts_is_reported() -> None:
    template = (
        "{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}"
    )
    tokenizer = byte_level_tokenizer()
    with pytest.raises(ChatTemplateError, match=r"System role not supported\..*system prompt"):
        ChatFormat(tokenizer, "Be brief.", chat_template=template)
    ChatFormat(tokenizer, chat_template=template)  # fine without one


def test_template_numbering_its_turns_is_refused() -> None:
    template = (
        "{% for message in messages %}{% if message['role'] == 'user' %}"
        "{{ '[Round ' ~ loop.index ~ ']\nQ: ' + message['content'] + '\n' }}"
        "{% else %}{{ 'A: ' + message['content'] + '</s>\n' }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="depending on the turns before it"):
        ChatFormat(byte_level_tokenizer(), chat_template=template)


def test_template_dropping_replies_is_refused() -> None:
    template = (
        "{% for message in messages %}{% if message['role'] == 'user' %}"
        "{{ '<|im_start|>user\n' + message['content'] + '<|im_end|>\n' }}"
        "{% else %}{{ '<|im_start|>assistant\n<|im_end|>\n' }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="does not render a reply") as caught:
        ChatFormat(byte_level_tokenizer(), chat_template=template)
    assert isinstance(caught.value, UnsupportedModelError)


def test_stop_ids_include_eos_generation_config_and_end_of_turn() -> None:
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    assert stop_token_ids(tokenizer) == {ids("</s>"), ids("<|im_end|>")}
    assert stop_token_ids(tokenizer, GenerationConfig(eos_token_id=ids("<|endoftext|>"))) == {
        ids("</s>"),
        ids("<|im_end|>"),
        ids("<|endoftext|>"),
    }
    assert stop_token_ids(tokenizer, GenerationConfig(eos_token_id=[ids("<|eot_id|>"), ids("</s>")])) == {
        ids("</s>"),
        ids("<|im_end|>"),
        ids("<|eot_id|>"),
    }
    assert stop_token_ids(sentencepiece_tokenizer()) == {sentencepiece_tokenizer().eos_token_id}


@pytest.mark.parametrize(
    ("template_name", "end_of_turn"),
    [("llama-3-instruct", "<|eot_id|>"), ("gemma-it", "<end_of_turn>"), ("phi-3", "<|end|>")],
)
def test_stop_ids_follow_the_chosen_template(template_name: str, end_of_turn: str) -> None:
    tokenizer = byte_level_tokenizer()
    chat = ChatFormat(tokenizer, chat_template=shared_template(template_name))
    stops = stop_token_ids(tokenizer, chat_format=chat)
    assert stops == {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(end_of_turn)}


@pytest.mark.default_model
@pytest.mark.parametrize("system", [None, SYSTEM], ids=["no-system", "system"])
def test_default_model_turns_add_up_to_whole_render(system: str | None) -> None:
    smollm2 = default_model_tokenizer_or_skip()
    assert_turns_add_up_to_whole_render(smollm2, None, system)
    assert_turns_add_up_to_whole_render(smollm2, fallback_template(smollm2), system)


@pytest.mark.default_model
def test_default_model_default_system_prompt_comes_first() -> None:
    smollm2 = default_model_tokenizer_or_skip()
    chat = ChatFormat(smollm2)
    assert smollm2.decode(chat.prompt_ids("Hi", first_turn=True)) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert stop_token_ids(smollm2, GenerationConfig(eos_token_id=2)) == {smollm2.convert_tokens_to_ids("<|im_end|>")}


@pytest.mark.default_model
def test_foreign_end_of_turn_spelled_as_text_is_refused() -> None:
    # SmolLM2 has no <|end|> token: a reply's final "." and the "<|" after it become one
    # token, so no cut separates the reply from the end of its turn.
    template = shared_template("phi-3")
    with pytest.raises(ChatTemplateError, match=r"a reply ending in '\.' merges into one token"):
        ChatFormat(default_model_tokenizer_or_skip(), chat_template=template)


def test_every_first_prompt_begins_with_the_system_turn_and_no_further():
    chat_format = ChatFormat(byte_level_tokenizer(), system_prompt=SYSTEM)
    turn = system_turn_length(chat_format)
    assert chat_format.common_start(turn) == chat_format.prompt_ids("Anything.", first_turn=True)[:turn]
    assert chat_format.common_start(turn + 8) is None  # the user's words
    assert chat_format.common_start(0) is None


def test_a_format_is_built_once_for_each_tokenizer_template_and_system_prompt():
    tokenizer = copy.deepcopy(byte_level_tokenizer())  # its template is changed below
    first = chat_format_for(tokenizer, SYSTEM)
    assert chat_format_for(tokenizer, SYSTEM) is first
    assert chat_format_for(tokenizer, "Other.").system_prompt == "Other."
    assert chat_format_for(sentencepiece_tokenizer(), SYSTEM) is not first
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    changed = chat_format_for(tokenizer, SYSTEM)
    assert changed.prompt_ids("Hi.", first_turn=True) != first.prompt_ids("Hi.", first_turn=True)
