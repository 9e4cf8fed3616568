"""The tool parsers (tool_choice "auto"): an answer split into its content and its calls, and how much of a
streamed answer is surely content."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from liteinfer.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    ParsedAnswer,
    ParsedToolCall,
)

WEATHER = ParsedToolCall("get_weather", '{"city": "Paris"}')
TIME = ParsedToolCall("get_time", '{"zone": "CET", "format": 24}')


@pytest.mark.parametrize("text, expected", [
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', ParsedAnswer(None, [WEATHER])),
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {"zone": "CET", "format": 24}}</tool_call>',
     ParsedAnswer("Let me look.\n", [WEATHER, TIME])),
    # The answer ended inside its last call's block, before the closing tag.
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', ParsedAnswer(None, [WEATHER])),
])
def test_hermes_splits_content_and_calls(text, expected):
    assert HermesToolParser().parse(text) == expected


@pytest.mark.parametrize("parser, text", [
    (HermesToolParser(), "It is sunny in Paris."),
    # Blocks that are not calls: the whole answer is content, as vLLM returns it.
    (HermesToolParser(), '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),
    (HermesToolParser(), '<tool_call>{"arguments": {}}</tool_call>'),
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
    (Llama3JsonToolParser(), "The weather is fine."),
    (Llama3JsonToolParser(), '{"name": "get_weather", "parameters": {"city": "Paris"}} and more'),
    (Llama3JsonToolParser(), '{"name": "get_weather", "parameters": {"city": "Par'),
    (Llama3JsonToolParser(), '{"city": "Paris"}'),
])
def test_an_answer_without_well_formed_calls_is_all_content(parser, text):
    assert parser.parse(text) == ParsedAnswer(text)


@pytest.mark.parametrize("text, expected", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', ParsedAnswer(None, [WEATHER])),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "arguments": {"zone": "CET", "format": 24}}', ParsedAnswer(None, [WEATHER, TIME])),
    ('  {"name": "get_weather", "parameters": {"city": "Paris"}}  ', ParsedAnswer(None, [WEATHER])),
])
def test_llama3_json_takes_an_answer_of_calls_only(text, expected):
    assert Llama3JsonToolParser().parse(text) == expected


def test_a_calls_arguments_are_a_json_object_as_text():
    call = HermesToolParser().parse('<tool_call>{"name": "f", "arguments": {"a": [1, 2], "b": "é"}}</tool_call>')
    assert json.loads(call.tool_calls[0].arguments) == {"a": [1, 2], "b": "é"}
    assert call.tool_calls[0].arguments == '{"a": [1, 2], "b": "é"}'  # not escaped to ASCII


@pytest.mark.parametrize("text, end", [
    ("Hello", 5), ("Hello <", 6), ("Hello <tool_", 6), ("Hello <tool_call>{", 6), ("Hello <b>", 9), ("", 0),
])
def test_hermes_holds_back_what_may_become_a_call(text, end):
    assert HermesToolParser().content_end(text) == end


@pytest.mark.parametrize("text, end", [
    ("", 0), ("  ", 0), ("<|python", 0), ("{", 0), ('  {"name"', 0), ("<|python_tag|>{", 0), ("Sure", 4),
    ("<b>", 3),
])
def test_llama3_json_streams_content_once_the_answer_is_not_a_call(text, end):
    assert Llama3JsonToolParser().content_end(text) == end


@given(st.lists(st.sampled_from(["a", " ", "<", "tool", "_call", ">", "{", "}", "</tool_call>", '"x"']), max_size=12))
def test_streamed_content_never_shrinks_and_never_passes_the_parsed_content(pieces):
    """What a stream sends as content, prefix by prefix, only grows and stays a prefix of the text; once whole,
    a parsed answer's content starts with all that was sent."""
    for parser in (HermesToolParser(), Llama3JsonToolParser()):
        text, sent = "", 0
        for piece in pieces:
            text += piece
            end = parser.content_end(text)
            assert 0 <= end <= len(text) and end >= sent
            sent = end
        parsed = parser.parse(text)
        content = text if not parsed.tool_calls else parsed.content or ""
        assert content.startswith(text[:sent])
