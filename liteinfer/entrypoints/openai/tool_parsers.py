"""Tool calls in a model's text, for `tool_choice="auto"` (vLLM's `--tool-call-parser`): each parser knows how one
family of models writes its calls, splits an answer into its content and its calls, and tells a stream how much of
the text so far is surely content (the rest may be the start of a call, held back until the answer ends)."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's form)


@dataclass(frozen=True)
class ParsedAnswer:
    """An answer split into its text and its tool calls; no calls: the whole text is content."""

    content: str | None
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class ToolParser(ABC):
    name: ClassVar[str]

    @abstractmethod
    def parse(self, text: str) -> ParsedAnswer:
        """The answer's content and calls. Text that looks like calls but does not parse is all content."""

    @abstractmethod
    def content_end(self, text: str) -> int:
        """How many leading characters of an unfinished answer are content whatever follows (a stream may send them)."""


def _call(payload: object, arguments_key: str) -> ParsedToolCall | None:
    """A call from a parsed JSON object holding a string "name" and an object of arguments; None otherwise."""
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(payload["name"], json.dumps(arguments, ensure_ascii=False))


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block a call, after any text (Hermes, Qwen 2.5
    and 3); the last block may lack its closing tag when the answer ends in it."""

    name = "hermes"
    START = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> ParsedAnswer:
        start = text.find(self.START)
        if start < 0:
            return ParsedAnswer(text)
        calls = []
        for block in self._BLOCK.findall(text[start:]):
            try:
                call = _call(json.loads(block), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return ParsedAnswer(text)
            calls.append(call)
        return ParsedAnswer(text[:start] or None, calls)

    def content_end(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        # A tail that could still grow into the start tag is held back.
        for size in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-size:]):
                return len(text) - size
        return len(text)


class Llama3JsonToolParser(ToolParser):
    """An answer that is nothing but calls, `{"name": ..., "parameters": {...}}`, several separated by `;`, maybe
    after `<|python_tag|>` (Llama 3.1, 3.2); any other answer is content."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedAnswer:
        body = text.strip().removeprefix(self.PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return ParsedAnswer(text)
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                payload, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return ParsedAnswer(text)
            call = _call(payload, "parameters" if isinstance(payload, dict) and "parameters" in payload
                         else "arguments")
            if call is None:
                return ParsedAnswer(text)
            calls.append(call)
            rest = body[at:].lstrip()
            if rest and not rest.startswith(";"):
                return ParsedAnswer(text)
            at = len(body) - len(rest.removeprefix(";").lstrip())
        return ParsedAnswer(None, calls)

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        # Undecided while only blanks or part of the tag have come; a call once it opens with either.
        if not body or self.PYTHON_TAG.startswith(body) or body.startswith((self.PYTHON_TAG, "{")):
            return 0
        return len(text)


TOOL_PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (HermesToolParser,
                                                                                 Llama3JsonToolParser)}
