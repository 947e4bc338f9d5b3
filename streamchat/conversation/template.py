"""The model's chat template, fed one turn at a time.

A streaming session never re-renders the conversation: the cache already holds every
earlier token, so each turn feeds only its new tokens. ChatFormat keeps that stream
identical to what transformers produces for the whole conversation at once,

    prompt_ids(user 1, first_turn=True) + reply 1 + end_of_turn_ids
    + prompt_ids(user 2, first_turn=False) + reply 2 + end_of_turn_ids + ...
    == tokenizer.apply_chat_template(conversation, tokenize=True)

where each reply is the tokenization of that assistant message as it appears in the
whole render, which is what a model trained on the template generates.

Text cannot simply be cut where one message ends. Tokens merge across the cut: the
render tokenizes "ASSISTANT: Hello" as ":", " Hello", so a prompt ending in the space
would feed a token the model never saw there; "\\n\\n" splits differently at the end of
a string than before a word; SentencePiece prepends "▁" only at the start of a text.
So every cut lies on a token boundary of a whole render:

- A turn is rendered and tokenized inside a short probe conversation that puts the
  same text before it (the system prompt, one probe exchange), and its tokens are
  those between the probe history's cut and the start of the reply.
- The prompt stops before any token that a common reply start would merge with, so
  the trailing space of "ASSISTANT: " moves into the reply, as llama.cpp does.
- A finished turn is cut where the render of the conversation continued by one more
  turn stops agreeing with it; the tokens from the end of the reply to that cut are
  the end of turn. Template text after the last message that the next turn would
  render differently (blank lines) is never fed.

The reference is the render of finished conversations, so the generation prompt is
not used: the prompt is whatever the template writes before a reply (the generation
prompt, for any template whose generation prompt matches its own history).
Construction checks the template against probe conversations and refuses, with the
reason, templates whose turns cannot be cut this way.

Tools (OpenAI's function specs) are part of a conversation's first turn, where templates that
describe them write them (the system turn: its sinks), so a format is built for a system prompt
and tools together. A reply that called tools is followed by a prompt turn of their results,
tool_results_ids, cut as a user turn is (the probe history ends in that reply's calls); a replay
renders such a reply as the template writes it (call_reply_ids). A format with tools refuses a
template that never reads them, and one whose tool turns cannot be cut.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import jinja2

from streamchat import defaults
from streamchat.conversation.message import Message, ToolCall, template_messages, tool_results_message
from streamchat.errors import ChatTemplateError, ConfigError
from streamchat.generation.detokenize import special_token_ids

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedTokenizerBase

# Stand-ins for the messages around the one being rendered.
_PROBE_USER = "Hi"
_PROBE_REPLY = "Hello"
# How replies commonly begin: the prompt stops before any token one of them merges with.
_REPLY_STARTS = ("Hello", "hello", "42", "東京", "🙂")
# How replies commonly end: each must end on a token boundary before the end of turn.
_REPLY_ENDS = ("Hello.", "Hello?", "Hello!", "42", "東京。", "🙂")
# A prompt longer than this (in characters) is probed for merges with a reply from near its end
# only: encoding all of a pasted megabyte once per reply start took seconds.
_LONG_TEXT = 4096
# How many of a long prompt's last tokens are encoded again to find where it meets the reply.
_TAIL_TOKENS = 64


def fallback_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """The chat format for models without a template, as in the StreamingLLM demo.

        [BOS][system prompt\\n\\n]USER: question\\n\\nASSISTANT: reply[EOS]\\n\\nUSER: ...

    BOS only where the tokenizer adds one itself (a base model saw it before every
    document); EOS closes each reply where the tokenizer has one, since a model that
    emitted it to stop must find it in its cache.
    """
    separator = json.dumps(defaults.FALLBACK_TURN_SEPARATOR)
    user_prefix = json.dumps(defaults.FALLBACK_USER_PREFIX)
    assistant_prefix = json.dumps(defaults.FALLBACK_ASSISTANT_PREFIX)
    bos = "{{ bos_token }}" if _adds_bos(tokenizer) else ""
    eos = "{{ eos_token }}" if tokenizer.eos_token else ""
    return (
        bos + "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ message['content'] }}"
        f"{{% elif message['role'] == 'user' %}}{{{{ {user_prefix} + message['content'] }}}}"
        f"{{% else %}}{{{{ {assistant_prefix} + message['content'] }}}}{eos}"
        f"{{% endif %}}{{{{ {separator} }}}}"
        "{% endfor %}"
        f"{{% if add_generation_prompt %}}{{{{ {assistant_prefix} }}}}{{% endif %}}"
    )


def _adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    bos_id = tokenizer.bos_token_id
    return bos_id is not None and tokenizer.encode(_PROBE_USER, add_special_tokens=True)[:1] == [bos_id]


@dataclass(frozen=True)
class _ClosedTurn:
    """Where a probe conversation ending in a finished reply is cut."""

    history_ids: list[int]  # everything up to the cut
    end_of_turn_ids: tuple[int, ...]  # from the end of the reply to the cut


class ChatFormat:
    """Per-turn token ids for one conversation with a chat template.

    The engine feeds prompt_ids(text, first_turn=True) for the first user message (it
    carries the template's BOS and system prompt), prompt_ids(text, first_turn=False)
    for every later one, and end_of_turn_ids after each reply: the tokens the template
    puts after a reply (such as "<|im_end|>\\n"), which must enter the cache even though
    the model emitted the first of them itself as its stop token.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        system_prompt: str | None = None,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._system_prompt = system_prompt
        self._tools = tools or None  # OpenAI's function specs, written into the first turn
        if chat_template is None and tokenizer.chat_template is not None:
            chat_template = tokenizer.get_chat_template()
        # True when the model has no template and gets the documented USER:/ASSISTANT: format.
        self.uses_fallback = chat_template is None
        self._template = chat_template or fallback_template(tokenizer)

        self._first_history: list[Message] = [_system(system_prompt)] if system_prompt else []
        self._later_history = [*self._first_history, _user(_PROBE_USER), _assistant(_PROBE_REPLY)]
        first_reply = self._close_turn(self._first_history)
        self._later_history_ids = first_reply.history_ids
        self.end_of_turn_ids: tuple[int, ...] = first_reply.end_of_turn_ids
        self._check_turns_repeat()
        if self._tools:
            self._check_tools(self._tools)

    @property
    def system_prompt(self) -> str | None:
        return self._system_prompt

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        return self._tools

    @property
    def template(self) -> str:
        """The chat template's text (the fallback's for a model without one)."""
        return self._template

    def common_start(self, count: int) -> list[int] | None:
        """The first `count` tokens of every first prompt; None where they would hold the user's own words."""
        first, other = (self.prompt_ids(text, first_turn=True)[:count] for text in ("Hi.", "Yes?"))
        return first if count and first == other and len(first) == count else None

    def reply_ids(self, reply_text: str) -> list[int]:
        """The tokens a finished reply puts in the cache: its text, then the end of turn."""
        return self._encode(reply_text) + list(self.end_of_turn_ids)

    def prompt_ids(self, user_text: str, *, first_turn: bool) -> list[int]:
        """The tokens that bring the conversation from the last reply to the model's next reply."""
        if first_turn:
            return self._turn_ids(self._first_history, [], _user(user_text))
        return self._turn_ids(self._later_history, self._later_history_ids, _user(user_text))

    def tool_results_ids(self, call: Message, results: Message) -> list[int]:
        """The tokens that bring the conversation from a reply that called tools (`call`, its turn closed) to the
        next reply: the results of its calls (`results`, a "tool" entry)."""
        history = [*self._first_history, _user(_PROBE_USER), call]
        return self._turn_ids(history, self._closed_call(history), results)

    def call_reply_ids(self, call: Message) -> list[int]:
        """The tokens a reply that called tools puts in the cache as the template writes it (a replay's; a live
        reply's are the model's own), its end of turn included."""
        prompt = self.prompt_ids(_PROBE_USER, first_turn=True)
        closed = self._closed_call([*self._first_history, _user(_PROBE_USER), call])
        if closed[: len(prompt)] != prompt:
            raise self._unsplittable("a reply that calls tools changes how the prompt before it is tokenized")
        return closed[len(prompt) :]

    def conversation_ids(self, messages: list[Message]) -> list[list[int]]:
        """The tokens each message of a conversation (a prompt turn first, then replies and prompt turns
        alternating) puts in the cache."""
        return [self._message_ids(messages, index) for index in range(len(messages))]

    def _message_ids(self, messages: list[Message], index: int) -> list[int]:
        message = messages[index]
        if message["role"] == "user":
            return self.prompt_ids(message["content"], first_turn=index == 0)
        if message["role"] == "tool":
            if index == 0 or not messages[index - 1].get("tool_calls"):
                raise ConfigError("tool results must follow a reply that called tools")
            return self.tool_results_ids(messages[index - 1], message)
        return self.call_reply_ids(message) if message.get("tool_calls") else self.reply_ids(message["content"])

    def _turn_ids(self, history: list[Message], history_ids: list[int], prompt: Message) -> list[int]:
        text = self._render([*history, prompt, _assistant(_PROBE_REPLY)])
        before_reply = text[: text.rfind(_PROBE_REPLY)]
        ids = self._encode(before_reply)
        if ids[: len(history_ids)] != history_ids:
            said = prompt["content"]
            raise self._unsplittable(f"the message {said!r} changes how the turn before it is tokenized")
        return ids[len(history_ids) : self._prompt_end(before_reply, ids)]

    def _closed_call(self, history: list[Message]) -> list[int]:
        """`history`, which ends in a reply that called tools, tokenized up to where the turn of its results cannot
        move the cut; that reply must close as every reply does (the cache closes a live one so)."""
        ids = self._encode(self._render(history))
        continued = self._render([*history, _probe_results(history[-1]), _assistant(_PROBE_REPLY)])
        closed = ids[: common_prefix_length(ids, self._encode(continued))]
        if tuple(closed[len(closed) - len(self.end_of_turn_ids) :]) != self.end_of_turn_ids:
            raise self._unsplittable("it ends a reply that calls tools differently from other replies")
        return closed

    def _check_tools(self, tools: list[dict[str, Any]]) -> None:
        probe = [*self._first_history, _user(_PROBE_USER)]
        if self._render(probe) == self._render(probe, with_tools=False):
            raise ChatTemplateError(
                "the model's chat template does not describe tools: it writes the same prompt with them as without, "
                "so the model would never see them; use a model whose template takes tools (Qwen2.5, Llama 3.1, ...)"
            )
        call = _probe_call(tools)
        self.tool_results_ids(call, _probe_results(call))
        self.call_reply_ids(call)

    def _prompt_end(self, text: str, ids: list[int]) -> int:
        """Where a prompt `text` tokenized as `ids` stops: before any token that a reply could merge
        with (the space of "ASSISTANT: "). Only its end can merge, so a long text is encoded again
        from a token boundary near its end, not whole."""
        offset, base = self._tail_boundary(text, ids) if len(text) > _LONG_TEXT else (0, 0)
        tail_text, tail_ids = text[offset:], ids[base:]
        return base + min(common_prefix_length(tail_ids, self._encode(tail_text + start)) for start in _REPLY_STARTS)

    def _tail_boundary(self, text: str, ids: list[int]) -> tuple[int, int]:
        """(character offset, token index) of a boundary near the end of `text` where encoding the
        rest alone gives the same tokens; (0, 0), the whole text, when none of the few tried is one.

        A token may end inside a character (byte-level pieces of 東), and a decoder may drop the
        space a token starts with (SentencePiece's "▁"): a few neighbouring cuts are tried.
        """
        for base in range(max(0, len(ids) - _TAIL_TOKENS), max(0, len(ids) - _TAIL_TOKENS - 4), -1):
            decoded = self._tokenizer.decode(ids[base:], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            tail = cast(str, decoded)  # one sequence of ids: one text
            end = len(text) - len(tail)
            if not text.endswith(tail):
                continue
            for offset in (end, end - 1):
                if offset > 0 and self._encode(text[offset:]) == ids[base:]:
                    return offset, base
        return 0, 0

    def _close_turn(self, history: list[Message], reply: str = _PROBE_REPLY) -> _ClosedTurn:
        """Cut [history, user, reply] after the reply, where the next turn cannot move the cut."""
        closed = [*history, _user(_PROBE_USER), _assistant(reply)]
        text = self._render(closed)
        reply_start = text.rfind(reply)
        if reply_start < text.rfind(_PROBE_USER):  # not after the user's message: dropped or changed
            raise self._unsplittable("it does not render a reply as the model wrote it")
        ids = self._encode(text)
        up_to_reply_end = self._encode(text[: reply_start + len(reply)])
        cut = common_prefix_length(ids, self._encode(self._render([*closed, *closed[-2:]])))
        if ids[: len(up_to_reply_end)] != up_to_reply_end or cut < len(up_to_reply_end):
            raise self._unsplittable(f"a reply ending in {reply[-1]!r} merges into one token with the text after it")
        return _ClosedTurn(ids[:cut], tuple(ids[len(up_to_reply_end) : cut]))

    def _check_turns_repeat(self) -> None:
        # Every reply must end the same way, whatever its last character; and only the first
        # turn may differ (BOS, system prompt): a template that numbers its turns or otherwise
        # looks back further cannot be rendered from a short probe history.
        for reply in _REPLY_ENDS:
            if self._close_turn(self._first_history, reply).end_of_turn_ids != self.end_of_turn_ids:
                raise self._unsplittable(f"it ends a reply ending in {reply[-1]!r} differently")
        second_reply = self._close_turn(self._later_history)
        if second_reply.end_of_turn_ids != self.end_of_turn_ids:
            raise self._unsplittable("it ends the first reply differently from later ones")
        longer_history = [*self._later_history, _user(_PROBE_USER), _assistant(_PROBE_REPLY)]
        third_turn = self._turn_ids(longer_history, second_reply.history_ids, _user(_PROBE_USER))
        if third_turn != self.prompt_ids(_PROBE_USER, first_turn=False):
            raise self._unsplittable("it renders a turn differently depending on the turns before it")

    def _render(self, messages: list[Message], with_tools: bool = True) -> str:
        tools = cast("list[dict[Any, Any] | Callable[..., Any]] | None", self._tools if with_tools else None)
        try:
            # tokenize=False renders the text.
            rendered = self._tokenizer.apply_chat_template(
                template_messages(messages), tools=tools, chat_template=self._template, tokenize=False
            )
            return cast(str, rendered)
        except jinja2.TemplateError as error:
            hint = " It may not accept a system prompt: try without one." if self._system_prompt else ""
            raise ChatTemplateError(f"the model's chat template refused the conversation: {error}.{hint}") from error

    def _encode(self, text: str) -> list[int]:
        # What apply_chat_template(tokenize=True) does: the template writes BOS itself.
        return self._tokenizer.encode(text, add_special_tokens=False)

    def _unsplittable(self, reason: str) -> ChatTemplateError:
        return ChatTemplateError(
            f"the model's chat template cannot be fed one turn at a time: {reason}. "
            "Use the plain USER:/ASSISTANT: format instead."
        )


def chat_format_for(
    tokenizer: PreTrainedTokenizerBase, system_prompt: str | None, tools: list[dict[str, Any]] | None = None
) -> ChatFormat:
    """ChatFormat(tokenizer, system_prompt, tools), built once for each tokenizer, template, system prompt and
    tools: a format is a value, and building one renders and checks sample turns (milliseconds a server's every
    new conversation would wait on the worker)."""
    described = json.dumps(tools) if tools else None  # in their order: the template writes them so
    return _chat_format(tokenizer, system_prompt, repr(tokenizer.chat_template), described)


@functools.lru_cache(maxsize=16)
def _chat_format(
    tokenizer: PreTrainedTokenizerBase, system_prompt: str | None, template: str, tools: str | None
) -> ChatFormat:
    # `template`: a template set later builds anew; `tools` as JSON text, a key the cache can hash.
    return ChatFormat(tokenizer, system_prompt=system_prompt, tools=None if tools is None else json.loads(tools))


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    generation_config: GenerationConfig | None = None,
    chat_format: ChatFormat | None = None,
) -> frozenset[int]:
    """Tokens that end a reply: the tokenizer's EOS, the generation config's EOS ids and the
    special tokens of the template's end of turn (<|im_end|>, <|eot_id|>, <end_of_turn>).

    chat_format defaults to the tokenizer's own template without a system prompt.
    """
    stop_ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        stop_ids.add(tokenizer.eos_token_id)
    config_eos: Any = generation_config.eos_token_id if generation_config is not None else None
    if isinstance(config_eos, int):
        stop_ids.add(config_eos)
    elif config_eos is not None:
        stop_ids.update(config_eos)
    # A model that learned the template emits its end of turn to stop; only the special
    # tokens there are stops, not the newline or space the template writes around them.
    end_of_turn = (chat_format or ChatFormat(tokenizer)).end_of_turn_ids
    stop_ids.update(special_token_ids(tokenizer).intersection(end_of_turn))
    return frozenset(stop_ids)


def common_prefix_length(first: Sequence[Any], second: Sequence[Any]) -> int:
    """How many first items (tokens, messages) two sequences share."""
    length = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        length += 1
    return length


def _system(content: str) -> Message:
    return {"role": "system", "content": content}


def _user(content: str) -> Message:
    return {"role": "user", "content": content}


def _assistant(content: str) -> Message:
    return {"role": "assistant", "content": content}


def _probe_call(tools: list[dict[str, Any]]) -> Message:
    """A reply calling the first tool. Its id has 9 letters and digits, as Mistral's templates require."""
    function = tools[0].get("function")
    name = str(function.get("name", "probe")) if isinstance(function, dict) else "probe"
    call: ToolCall = {"id": "call00001", "type": "function", "function": {"name": name, "arguments": "{}"}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def _probe_results(call: Message) -> Message:
    return tool_results_message(
        [{"tool_call_id": c["id"], "content": _PROBE_REPLY} for c in call.get("tool_calls", [])]
    )
