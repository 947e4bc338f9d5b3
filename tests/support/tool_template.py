"""A Hermes-style ChatML template that describes tools (as Qwen2.5's does, shortened), and tiny models over it.

Tools go in the system turn as JSON lines inside <tools></tools>; a reply calls one with
<tool_call>{"name": ..., "arguments": {...}}</tool_call>; the results come back as a user turn of
<tool_response> blocks, consecutive tool messages in one turn.
"""

from __future__ import annotations

import copy
from typing import Any

from tests.support.model_dirs import scripted_model_and_tokenizer
from tests.support.tokenizers import byte_level_tokenizer_with

HERMES_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall one with <tool_call>{"name": <name>, "arguments": <object>}</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- set tool_call = tool_call.function %}"
    '{{- \'<tool_call>{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{- (tool_call.arguments | tojson) + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
# The scripted model's call: each piece one token.
CALL_PIECES = ("<tool_call>", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "</tool_call>")


def tool_tokenizer() -> Any:
    return byte_level_tokenizer_with(HERMES_TOOLS_TEMPLATE)


def scripted_tool_model(pieces: tuple[str, ...] = CALL_PIECES) -> tuple[Any, Any]:
    """scripted_model_and_tokenizer(pieces) whose tokenizer's template describes tools."""
    model, tokenizer = scripted_model_and_tokenizer(pieces)
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = HERMES_TOOLS_TEMPLATE
    return model, tokenizer
