"""Per-request sampling parameters, with vLLM's names, defaults and validation rules."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from numbers import Integral, Real

from liteinfer.sampling.structured import StructuredOutputsParams

# Below this temperature a request is sampled greedily: dividing logits by ~0 would overflow anyway.
_GREEDY_TEMPERATURE = 1e-5

_INT_FIELDS = ("n", "top_k", "min_tokens")
_OPTIONAL_INT_FIELDS = ("seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_BOOL_FIELDS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens")


class RequestOutputKind(enum.Enum):
    """Which steps report a request, and with what (vLLM's names): CUMULATIVE, every step that gives it a token, with
    everything so far; DELTA, the same steps, each with only what is new since the previous report (a streaming
    caller's kind); FINAL_ONLY, only the step that finishes it, with everything. `LLM.generate` and
    `AsyncLLM.generate` ask for FINAL_ONLY: a cumulative output copies the tokens and text so far, so building one
    for every running request every step grows with them (256 requests of 128 tokens on a model whose compute is
    negligible, 2 Zen 3 cores: a step's median 15.1 ms, 12.0 without)."""

    CUMULATIVE = enum.auto()
    DELTA = enum.auto()
    FINAL_ONLY = enum.auto()


@dataclass
class SamplingParams:
    """How one request picks its next tokens and when it stops; validated on construction."""

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the context limit, resolved by the engine
    min_tokens: int = 0
    stop: str | list[str] | None = None  # always a list[str] after construction
    stop_token_ids: list[int] | None = None  # always a list[int] after construction
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # top logprobs per position besides the sampled token; 0 = sampled only; -1 = all
    # Top logprobs at each prompt position besides the prompt's own next token (0: that token only; -1: all); the first
    # prompt token has none. Every prompt position is computed: the prefix cache is not looked up for the request.
    prompt_logprobs: int | None = None
    # Keep only the prompt's last k tokens (vLLM's); -1: as many as leave room for one generated token.
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    # Edits of the logits before sampling (vLLM's names and order, after the raw logprobs are taken): only these
    # tokens may be sampled; the last token of a bad word is banned once the output ends with the rest of it (each word
    # tokenized as it would begin text and, with a space before it, as it would follow a word); a bias added to each
    # listed token's logit (OpenAI's logit_bias; keys are token ids).
    allowed_token_ids: list[int] | None = None
    bad_words: str | list[str] | None = None  # always a list[str] after construction
    logit_bias: dict[int, float] | None = None
    # Output in a format (a JSON schema, a regex, a choice, a grammar): only the tokens that keep to it are sampled.
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self._check_types()
        self._check_ranges()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE

    def _check_types(self) -> None:
        # Wrong types raise ValueError like bad values do, so callers (e.g. an HTTP layer) need one except.
        for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_INT_FIELDS:
                continue
            _require(_is_int(value), f"{name} must be an int, got {value!r}")
            setattr(self, name, int(value))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _require(_is_finite(value), f"{name} must be a finite number, got {value!r}")
            setattr(self, name, float(value))
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            _require(isinstance(value, bool), f"{name} must be a bool, got {value!r}")

        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        _require(
            isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop),
            f"stop must be a str or a list of str, got {self.stop!r}",
        )
        self.stop = list(stop)
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        _require(
            isinstance(ids, (list, tuple)) and all(_is_int(t) for t in ids),
            f"stop_token_ids must be a list of int, got {self.stop_token_ids!r}",
        )
        self.stop_token_ids = [int(t) for t in ids]

        allowed = self.allowed_token_ids
        _require(
            allowed is None or (isinstance(allowed, (list, tuple)) and all(_is_int(t) for t in allowed)),
            f"allowed_token_ids must be None or a list of int, got {allowed!r}",
        )
        if allowed is not None:
            self.allowed_token_ids = [int(t) for t in allowed]
        words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words or []
        _require(
            isinstance(words, (list, tuple)) and all(isinstance(w, str) for w in words),
            f"bad_words must be a str or a list of str, got {self.bad_words!r}",
        )
        self.bad_words = list(words)
        bias = self.logit_bias
        _require(
            bias is None or (isinstance(bias, dict) and all(_is_int(t) and _is_finite(v) for t, v in bias.items())),
            f"logit_bias must be None or a dict of token id (int) to a finite number, got {bias!r}",
        )
        if bias is not None:
            self.logit_bias = {int(t): float(v) for t, v in bias.items()}
        _require(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                 f"structured_outputs must be None or a StructuredOutputsParams, got {self.structured_outputs!r}")

    def _check_ranges(self) -> None:
        _require(self.n >= 1, f"n must be >= 1, got {self.n}")
        _require(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= -1, f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        _require(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _require(
            self.max_tokens is None or self.max_tokens >= 1,
            f"max_tokens must be None or >= 1, got {self.max_tokens}",
        )
        _require(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _require(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        penalty = self.repetition_penalty
        _require(penalty > 0, f"repetition_penalty must be > 0, got {penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(-2 <= value <= 2, f"{name} must be in [-2, 2], got {value}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or value >= -1, f"{name} must be None, >= 0, or -1 (the whole vocabulary), got "
                                                   f"{value}")
        _require(self.truncate_prompt_tokens in (None, -1) or self.truncate_prompt_tokens >= 1,
                 f"truncate_prompt_tokens must be None, -1 or >= 1, got {self.truncate_prompt_tokens}")
        _require(all(self.stop), f"stop strings must be non-empty, got {self.stop!r}")
        _require(self.allowed_token_ids != [], "allowed_token_ids must not be empty (None allows every token)")
        _require(all(w.strip() for w in self.bad_words), f"bad_words must be words, not blank, got {self.bad_words!r}")
        # Tokenized only when the request is queued: a word the tokenizer cannot take (a lone surrogate, which a JSON
        # string's escapes can carry) must fail here, before anything is queued.
        _require(all(map(_is_unicode, self.bad_words)), f"bad_words must be valid Unicode, got {self.bad_words!r}")
        _require(isinstance(self.output_kind, RequestOutputKind),
                 f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_finite(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    # bool is an int subclass, but True as a count or token id is a caller bug.
    return isinstance(value, Integral) and not isinstance(value, bool)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
