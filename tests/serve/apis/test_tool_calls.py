"""Tool calls read from a reply's text in each family's syntax, where a stream holds text back, and the grammar
of a reply that must call a tool."""

from __future__ import annotations

import json

import pytest

from streamchat.generation.constraint import LarkFormat
from streamchat.serve.apis.openai_tools import HeldText
from streamchat.serve.apis.tool_calls import call_start, read_tool_calls, tool_call_grammar, tool_family
from tests.support.tool_template import HERMES_TOOLS_TEMPLATE, TIME_TOOL, WEATHER_TOOL


def called(family, text):
    read = read_tool_calls(family, text)
    return read.content, [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in read.calls]


def test_hermes_calls_are_read_with_the_text_outside_them():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text += '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert called("hermes", text) == ("Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {})])


def test_a_call_gets_an_openai_id_and_its_arguments_as_json_text():
    (call,) = read_tool_calls("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>').calls
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["arguments"] == '{"a": 1}'


def test_llama_calls_are_the_whole_reply_as_json_with_parameters():
    assert called("llama", '<|python_tag|>{"name": "get_time", "parameters": {}}') == ("", [("get_time", {})])
    assert called("llama", '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}') == (
        "",
        [("a", {"x": 1}), ("b", {})],
    )


def test_mistral_calls_are_a_list_after_the_marker():
    text = '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    assert called("mistral", text) == ("", [("a", {"x": 1}), ("b", {})])
    assert called("mistral", '[{"name": "a", "arguments": {}}]') == ("", [("a", {})])  # the marker, a special token


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("hermes", '<tool_call>{"name": "f", "arguments": {</tool_call>'),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
        ("hermes", "No calls here."),
        ("llama", '{"name": "f", "parameters": '),
        ("llama", "The answer is {42}."),
        ("mistral", "[TOOL_CALLS][{]"),
        ("mistral", "[1, 2]"),
    ],
)
def test_a_reply_whose_calls_do_not_parse_is_text(family, text):
    assert called(family, text) == (text, [])


def test_the_family_is_read_from_the_template():
    assert tool_family(HERMES_TOOLS_TEMPLATE) == "hermes"
    assert tool_family("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert tool_family("{{ '<|python_tag|>' }} ipython") == "llama"
    assert tool_family("{{ messages }}") is None


def test_a_stream_holds_back_what_may_begin_a_call():
    assert call_start("hermes", "Let me see. <tool") == len("Let me see.")
    assert call_start("hermes", "Plain text") is None
    assert call_start("llama", "  {") == 0 and call_start("llama", "Hello") is None
    held = HeldText("hermes")
    sent = [held.add(piece) for piece in ("Hi", " there", " <tool_", "call>{}", "</tool_call>")]
    assert sent == ["Hi", " there", "", "", ""]
    assert held.rest("Hi there") == ""
    text = HeldText("hermes")
    assert [text.add("a <"), text.add("b")] == ["a", " <b"]  # not a marker after all


@pytest.mark.parametrize("family", ["hermes", "llama", "mistral"])
def test_the_grammar_of_a_required_call_compiles(family):
    for name in (None, "get_time"):
        for parallel in (True, False):
            LarkFormat(tool_call_grammar(family, [WEATHER_TOOL, TIME_TOOL], name, parallel))


def test_a_reply_without_tools_is_sent_as_it_comes():
    held = HeldText(None)
    deltas = ["Hi ", "<tool", "_call>", '{"name": "f"}', "</tool_call>", " "]
    assert [held.add(delta) for delta in deltas] == deltas
    assert held.rest(None) == "" and held.sent == held.text == "".join(deltas)
