"""Structured outputs: a request's format (a JSON schema, any JSON object, a regular expression, one of some strings,
or a Lark grammar) as the tokens it allows at each step, through llguidance's matcher (vLLM's `guidance` backend).

A sequence holds its own matcher; the sampler masks the row's logits with the matcher's allowed tokens, and the engine
feeds the matcher each token it appends. Once the format is complete the matcher allows only the end-of-sequence
tokens, so the sequence ends as any other does.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

# Compiled formats kept for reuse (a server's requests often share a schema); each new sequence takes a copy.
_COMPILED_FORMATS_KEPT = 64


# The formats, and what each takes (for error messages).
_EXPECTED = {"json": "a JSON schema (a dict or its text)", "json_object": "true", "regex": "a str",
             "choice": "a non-empty list of str", "grammar": "a str (Lark or GBNF)"}


@dataclass
class StructuredOutputsParams:
    """vLLM's names: exactly one of `json` (a JSON schema, as a dict or its text), `json_object` (any JSON object),
    `regex`, `choice` (one of these strings) and `grammar` (Lark, llguidance's dialect, or GBNF). JSON may have any
    whitespace between its tokens (vLLM's default) unless `disable_any_whitespace`: then none."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in _EXPECTED if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of json, json_object, regex, choice and grammar, "
                             f"got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs json is not valid JSON: {exc}") from None
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs disable_any_whitespace must be a bool, got "
                             f"{self.disable_any_whitespace!r}")
        choice = self.choice
        checks = {
            "json": isinstance(self.json, dict),
            "json_object": self.json_object is True,
            "regex": isinstance(self.regex, str),
            "choice": isinstance(choice, list) and bool(choice) and all(isinstance(c, str) for c in choice),
            "grammar": isinstance(self.grammar, str),
        }
        name = given[0]
        if not checks[name]:
            raise ValueError(f"structured_outputs {name} must be {_EXPECTED[name]}, got {getattr(self, name)!r}")

    def grammar_text(self) -> str:
        """The format as a grammar llguidance compiles."""
        if self.json is not None or self.json_object:
            schema = {"type": "object"} if self.json is None else self.json
            options = {"whitespace_flexible": not self.disable_any_whitespace}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:  # JSON string literals are Lark's too
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, self.choice)))
        return llguidance.grammar_from("grammar", self.grammar)  # Lark, or GBNF (llama.cpp's, vLLM's EBNF examples)


class GrammarMatchers:
    """Makes the matchers of one tokenizer's requests. The tokenizer's llguidance form is built on first use (~0.5 s
    for a 49k vocabulary), so engines whose requests never ask for a format never pay for it."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, sorted(eos_token_ids)
        self._compiled = functools.lru_cache(maxsize=_COMPILED_FORMATS_KEPT)(self._compile)

    @functools.cached_property
    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        return llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)

    def check(self, params: StructuredOutputsParams) -> None:
        """Raises ValueError, with llguidance's reason, for a format that does not compile."""
        self._compiled(params.grammar_text())

    def matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A matcher at the start of the format, for one sequence."""
        return self._compiled(params.grammar_text()).deep_copy()

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._llg_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: the format does not compile: {matcher.get_error()}")
        return matcher


def allowed_tokens(matchers: list[llguidance.LLMatcher], vocab_size: int) -> torch.Tensor:
    """[len(matchers), vocab_size] bool: the tokens each matcher allows next."""
    words = np.stack([np.frombuffer(m.compute_bitmask(), dtype=np.uint8) for m in matchers])
    bits = np.unpackbits(words, axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.astype(bool))
