"""A reply held to a JSON schema: whatever the logits, what it draws parses and validates, and it ends once the value
is whole; a token taken back leaves the grammar where it stood; schemas the grammar cannot hold are refused by name."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from streamchat.errors import ConfigError
from streamchat.generation.constraint import JsonFormat
from tests.support.tokenizers import byte_level_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


def stop_ids(tokenizer) -> frozenset[int]:
    return frozenset({tokenizer.convert_tokens_to_ids("<|im_end|>")})


def drawn(json_format: JsonFormat, seed: int, limit: int = 200) -> tuple[str, bool]:
    """Tokens drawn from random logits under the grammar until a stop token: the text, and whether it stopped."""
    tokenizer = byte_level_tokenizer()
    stops = stop_ids(tokenizer)
    constraint = json_format.constraint(tokenizer, stops)
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(limit):
        row = constraint.masked(torch.randn(len(tokenizer), generator=generator) * 4)
        token = int(torch.multinomial(row.softmax(-1), 1, generator=generator))
        constraint.accept(token)
        if token in stops:
            return tokenizer.decode(tokens), True
        tokens.append(token)
    return tokenizer.decode(tokens), False


@pytest.mark.parametrize("seed", range(12))
def test_whatever_the_logits_a_held_reply_is_one_valid_value_then_a_stop(seed):
    text, stopped = drawn(JsonFormat(PERSON), seed)
    assert stopped
    jsonschema.validate(json.loads(text), PERSON)
    assert text.startswith('{"name": "')  # the separators models were trained on, no stray whitespace


def test_json_object_means_any_object():
    text, stopped = drawn(JsonFormat({"type": "object", "maxProperties": 0}), seed=1)
    assert (text, stopped) == ("{}", True)


def test_a_token_taken_back_leaves_the_grammar_where_it_stood():
    tokenizer = byte_level_tokenizer()
    constraint = JsonFormat(PERSON).constraint(tokenizer, stop_ids(tokenizer))
    zeros = torch.zeros(len(tokenizer))
    before = constraint.masked(zeros)
    first = int(torch.isfinite(before).nonzero()[0])
    constraint.accept(first)
    after = constraint.masked(zeros)
    assert not torch.equal(torch.isfinite(after), torch.isfinite(before))
    constraint.take_back()
    assert torch.equal(torch.isfinite(constraint.masked(zeros)), torch.isfinite(before))
    assert not constraint.whole


def test_only_a_stop_token_follows_a_whole_value():
    tokenizer = byte_level_tokenizer()
    stops = stop_ids(tokenizer)
    constraint = JsonFormat({"enum": [True]}).constraint(tokenizer, stops)
    for token in tokenizer.encode("true", add_special_tokens=False):
        constraint.accept(token)
    assert constraint.whole
    allowed = torch.isfinite(constraint.masked(torch.zeros(len(tokenizer)))).nonzero().flatten().tolist()
    assert set(allowed) == stops


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "strin"}, "Invalid type: strin"),
        ({"properties": {"a": {"$ref": "#/nowhere"}}}, "/nowhere"),
    ],
)
def test_a_schema_the_grammar_cannot_hold_is_refused_with_why(schema, words):
    with pytest.raises(ConfigError, match="cannot constrain a reply") as refused:
        JsonFormat(schema)
    assert words in str(refused.value)
