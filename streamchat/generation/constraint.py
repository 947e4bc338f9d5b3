"""Constrained decoding: a reply that can only be what a grammar allows: one JSON value, as a JSON schema
describes it (JsonFormat), or any text a Lark grammar describes (LarkFormat: a tool call's syntax around
inline JSON schemas, `%json {...}`).

    json_format = JsonFormat(schema)                  # None: any JSON object; checked (ConfigError) when made
    constraint = json_format.constraint(tokenizer, stop_ids)    # any ReplyFormat's
    each token:  row = constraint.masked(row)         # what the grammar does not allow can no longer be drawn
                 constraint.accept(token)             # the token fed; take_back() undoes the last one

The grammar is llguidance's (the library vLLM, SGLang and llama.cpp use): a JSON schema
compiles in about a millisecond, and it computes the tokens allowed next in tens of
microseconds for a 49k vocabulary (a whole step takes milliseconds), so a constrained
reply costs little and the others in the step nothing: each reply draws from its own row.
Once the value (the grammar's text) is whole only a stop token is allowed, so the reply ends there. Separators
are fixed (", " and ": ") and no other whitespace is allowed between tokens, so a small
model cannot wander into endless blank lines. The tokenizer's token table for the grammar
is built once per tokenizer (a third of a second for 49k tokens) and kept.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from streamchat.errors import CacheStateError, ConfigError

# JSON as models were trained to write it, and nothing that lets them loop: llguidance's options, which a schema's
# own "x-guidance" entry may override.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Any JSON object: response_format {"type": "json_object"}.
ANY_OBJECT: Mapping[str, Any] = {"type": "object"}

# llguidance's token table for each tokenizer (and its stop tokens), built once.
_token_tables: weakref.WeakKeyDictionary[Any, dict[frozenset[int], Any]] = weakref.WeakKeyDictionary()


class ReplyFormat:
    """What a reply is held to: an llguidance grammar (`grammar`, checked when made)."""

    grammar: str

    def constraint(self, tokenizer: Any, stop_ids: frozenset[int]) -> Constraint:
        """A new reply's constraint: its tokens from `tokenizer` form what the grammar allows, then one of `stop_ids`
        ends it."""
        import llguidance

        table = _token_table(tokenizer, stop_ids)
        return Constraint(llguidance.LLMatcher(table, self.grammar, log_level=0), table.vocab_size, stop_ids)


@dataclass(frozen=True)
class LarkFormat(ReplyFormat):
    """A reply held to a Lark grammar (llguidance's dialect: `%json {schema}` inlines a JSON schema). ConfigError,
    when made, says what is wrong with one that cannot constrain a reply."""

    lark: str
    grammar: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_lark(self.lark)
        problem = llguidance.LLMatcher.validate_grammar(grammar)
        if problem:
            raise ConfigError(f"the grammar cannot constrain a reply: {problem}")
        object.__setattr__(self, "grammar", grammar)


@dataclass(frozen=True)
class JsonFormat(ReplyFormat):
    """A reply that is one JSON value of `schema` (None: any JSON object). ConfigError, when made, says what is
    wrong with a schema the grammar cannot hold."""

    schema: Mapping[str, Any] | None = None
    name: str = ""  # what the client called it (OpenAI's json_schema.name), for messages
    grammar: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        import llguidance

        schema = ANY_OBJECT if self.schema is None else self.schema
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(dict(schema), defaults=JSON_LAYOUT)  # type: ignore[arg-type]
        except (ValueError, TypeError) as error:
            raise ConfigError(f"the JSON schema cannot be read: {error}") from None
        problem = llguidance.LLMatcher.validate_grammar(grammar)
        if problem:
            raise ConfigError(f"the JSON schema cannot constrain a reply: {problem}")
        object.__setattr__(self, "grammar", grammar)


class Constraint:
    """One reply's grammar, where it stands: which tokens it allows next, and the tokens fed so far."""

    def __init__(self, matcher: Any, vocab_size: int, stop_ids: frozenset[int]) -> None:
        import llguidance.numpy

        self._matcher = matcher
        self._stop_ids = stop_ids
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
        self._fill = llguidance.numpy.fill_next_token_bitmask
        self._consumed: list[bool] = []  # per token fed: whether the grammar took it (a stop token it does not)

    def masked(self, row: torch.Tensor) -> torch.Tensor:
        """`row` [vocab] with every token the grammar does not allow next at -inf (the table's end-of-text tokens,
        the stop tokens, are allowed once the value is whole)."""
        self._fill(self._matcher, self._bitmask, 0)
        # [1, words] of 32 bits, lowest bit first -> [vocab] allowed flags
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: row.shape[-1]]
        disallowed = torch.from_numpy(allowed == 0)
        if bool(disallowed.all()):
            raise CacheStateError(f"the grammar allows no token: {self._matcher.get_error() or 'it is stuck'}")
        return row.masked_fill(disallowed.to(row.device), -torch.inf)

    def accept(self, token: int) -> None:
        """`token` was fed: the grammar moves past it (a stop token ends the reply and is not part of the value)."""
        if token in self._stop_ids:
            self._consumed.append(False)
            return
        if not self._matcher.consume_token(token):
            raise CacheStateError(f"a token the grammar does not allow was fed: {self._matcher.get_error()}")
        self._consumed.append(True)

    def take_back(self) -> None:
        """The last token fed was taken back: so is the grammar's step past it."""
        if self._consumed and self._consumed.pop():
            self._matcher.rollback(1)

    @property
    def whole(self) -> bool:
        """Whether what was fed is a whole value (the reply may end here)."""
        return bool(self._matcher.is_accepting())


def _token_table(tokenizer: Any, stop_ids: frozenset[int]) -> Any:
    """llguidance's table of `tokenizer`'s tokens, its end-of-text tokens `stop_ids`; built once and kept."""
    import llguidance.hf

    tables = _token_tables.setdefault(tokenizer, {})
    if stop_ids not in tables:
        tables[stop_ids] = llguidance.hf.from_tokenizer(tokenizer, eos_token=sorted(stop_ids))
    return tables[stop_ids]
