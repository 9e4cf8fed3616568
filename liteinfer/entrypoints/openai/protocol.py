"""The OpenAI wire format: pydantic models of the requests the server accepts and the responses it sends."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from liteinfer.engine.llm_engine import PromptType
from liteinfer.engine.prompts import Message
from liteinfer.sampling import SamplingParams, StructuredOutputsParams

# SamplingParams fields a request may set under the same name; None (or absent) leaves SamplingParams' default.
_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "allowed_token_ids", "bad_words",
    "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens",
)
# OpenAI's range for a logit bias; vLLM clamps a larger one into it.
_MAX_LOGIT_BIAS = 100.0


class OpenAIRequest(BaseModel):
    # Strict, as OpenAI's own API is: "0.5" is not a number and 1 is not a bool. Unknown fields are ignored, since
    # clients send some we have no use for (user, metadata, ...).
    model_config = ConfigDict(strict=True, extra="ignore")
    # Fields we know but do not implement: refused when set, rather than silently ignored.
    unsupported: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in cls.unsupported:
                if data.get(name) not in (None, False, [], {}):
                    raise ValueError(f"{name} is not supported by this server")
        return data


class StreamOptions(OpenAIRequest):
    include_usage: bool = False


class ResponseFormat(OpenAIRequest):
    """OpenAI's: plain text, any JSON object, or JSON keeping to `json_schema["schema"]`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None  # {"name": ..., "schema": {...}, "strict": ...}

    def structured_outputs(self) -> dict[str, Any] | None:
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            if not self.json_schema or not isinstance(self.json_schema.get("schema"), dict):
                raise ValueError("response_format of type json_schema needs json_schema.schema, a JSON schema")
            return {"json": self.json_schema["schema"]}
        return None


class SamplingRequest(OpenAIRequest):
    """What completions and chat share; top_k, min_p, repetition_penalty, min_tokens, ignore_eos, allowed_token_ids,
    bad_words, stop_token_ids, include_stop_str_in_output, skip_special_tokens and truncate_prompt_tokens are extras
    beyond OpenAI's set, with vLLM's names."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are strings) -> bias
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's extra: each prompt token's logprob and the top `prompt_logprobs` tokens at its position, in a whole
    # response (a completion's choices, a chat response's top level); streamed responses refuse it, as vLLM's do.
    prompt_logprobs: int | None = None
    # A format the output keeps to: OpenAI's response_format, or vLLM's structured_outputs (StructuredOutputsParams'
    # fields) and its older guided_json, guided_regex, guided_choice, guided_grammar.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_params(self, defaults: dict[str, Any], max_tokens: int | None, logprobs: int | None,
                        echo_logprobs: int | None = None) -> SamplingParams:
        """The request's SamplingParams: the fields it leaves out (None) take the model's recommended `defaults`
        (`LLMEngine.sampling_defaults`), then SamplingParams' own; the engine computes the prompt's logprobs for the
        `prompt_logprobs` field and an echo's `echo_logprobs` alike, at the larger top count of the two. Raises
        ValueError (naming the field first) for values SamplingParams refuses."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is for streamed responses only: set stream to true, or leave it out")
        if self.stream and self.prompt_logprobs:  # 0 passes, as in vLLM: then nothing is asked of the engine
            raise ValueError("prompt_logprobs are not available in streamed responses: leave stream out")
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        asked = [top for top in (None if self.stream else self.prompt_logprobs, echo_logprobs) if top is not None]
        given["max_tokens"] = defaults.get("max_tokens") if max_tokens is None else max_tokens
        if self.logit_bias:
            given["logit_bias"] = self._logit_bias_by_token_id()
        if (formats := self._structured_outputs()) is not None:
            given["structured_outputs"] = formats
        return SamplingParams(**{**defaults, **given}, logprobs=logprobs, prompt_logprobs=max(asked, default=None))

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        asked = {}
        if self.response_format is not None and (fields := self.response_format.structured_outputs()) is not None:
            asked["response_format"] = fields
        if self.structured_outputs is not None:  # {} too, which StructuredOutputsParams refuses
            asked["structured_outputs"] = self.structured_outputs
        if guided := {name: getattr(self, f"guided_{name}") for name in ("json", "regex", "choice", "grammar")
                      if getattr(self, f"guided_{name}") is not None}:
            asked["guided_*"] = guided
        if len(asked) > 1:
            raise ValueError(f"structured_outputs: give the output's format once, got {', '.join(asked)}")
        if not asked:
            return None
        fields = next(iter(asked.values()))
        if unknown := set(fields) - {f.name for f in dataclasses.fields(StructuredOutputsParams)}:
            raise ValueError(f"structured_outputs has no field {', '.join(sorted(unknown))}")
        return StructuredOutputsParams(**fields)

    def _logit_bias_by_token_id(self) -> dict[int, float]:
        by_id = {}
        for key, bias in self.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            if not math.isfinite(bias):  # JSON as Python reads it takes NaN and Infinity
                raise ValueError(f"logit_bias values must be finite numbers, got {bias} for {key!r}")
            by_id[token_id] = min(_MAX_LOGIT_BIAS, max(-_MAX_LOGIT_BIAS, bias))
        return by_id

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    unsupported: ClassVar[tuple[str, ...]] = ("suffix", "best_of")

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default; null = up to the context limit
    logprobs: int | None = Field(default=None, ge=0, le=20)
    # The prompt before each choice's text, and with logprobs its tokens' logprobs before the choice's (the first
    # token's null: nothing predicts it), as OpenAI's legacy API and vLLM do (what evaluation harnesses score with).
    echo: bool = False

    def prompts(self) -> list[PromptType]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt[0], int):
            return [{"prompt_token_ids": prompt}]
        return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


class TextPart(OpenAIRequest):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIRequest):
    name: str
    arguments: str  # a JSON object, as text


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's form


class ToolCall(OpenAIRequest):
    """A call an assistant message made (in a request's history, or a response's message)."""

    id: str = Field(default_factory=tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIRequest):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, earlier in the conversation
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    def as_template_message(self) -> Message:
        """The message as chat templates read it: text parts are joined by render_chat (engine/prompts.py:
        template_messages); a call's arguments are a mapping, which templates write out (vLLM hands them so)."""
        message = self.model_dump(exclude_none=True)
        for call in message.get("tool_calls", []):
            with contextlib.suppress(json.JSONDecodeError):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        return message


class FunctionDefinition(OpenAIRequest):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(OpenAIRequest):
    type: Literal["function"]
    function: FunctionDefinition


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """Tools as chat templates take them (transformers' `tools`): OpenAI's form, as vLLM passes it."""
    return None if not tools else [tool.model_dump(exclude_none=True) for tool in tools]


class NamedFunction(OpenAIRequest):
    name: str


class NamedToolChoice(OpenAIRequest):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    unsupported: ClassVar[tuple[str, ...]] = ("functions", "function_call", "audio")

    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's extras for the chat template (engine/prompts.py: render_chat).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = None  # null = up to the context limit
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Functions the model may call: the chat template shows them to it; `tool_choice` says what it must do with them
    # ("none": answer in text; "auto": text or calls, found by the server's tool parser; "required": one call or
    # more; a named function: that one, its arguments kept to its schema). With tools and no choice, "auto".
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: "required" makes exactly one call (else one or more)

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"
        if self.tool_choice == "none":
            return self
        if not self.tools:
            raise ValueError(f"tool_choice {self.chosen_tool or self.tool_choice!r} needs tools")
        if self.chosen_tool is not None and self.chosen_tool not in {tool.function.name for tool in self.tools}:
            raise ValueError(f"tool_choice names the function {self.chosen_tool!r}, which tools do not define")
        return self

    @property
    def chosen_tool(self) -> str | None:
        """The function a named tool_choice asks for."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def conversation(self) -> list[Message]:
        return [message.as_template_message() for message in self.messages]

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """A required or named tool_choice keeps the output to the calls' JSON (vLLM's way): a JSON array of
        {"name", "parameters"} objects, one of the tools each, or the named function's arguments. Without the
        whitespace JSON allows between its tokens (vLLM allows it): a small model can fill its whole output with
        it, and compact arguments are what clients get from OpenAI."""
        given = super()._structured_outputs()
        if self.tool_choice in ("auto", "none"):
            return given
        if given is not None:
            raise ValueError("tool_choice: a required or named tool_choice sets the output's format; leave out "
                             "response_format, structured_outputs and guided_*")
        schemas = {tool.function.name: tool.function.parameters or {"type": "object"} for tool in self.tools}
        if self.chosen_tool is not None:
            return StructuredOutputsParams(json=schemas[self.chosen_tool], disable_any_whitespace=True)
        # A schema's `$ref`s point at its root's `$defs`: in the array's schema, that is the array's root.
        definitions: dict[str, Any] = {}
        calls = []
        for name, schema in schemas.items():
            own = schema.get("$defs", {})
            for key, definition in own.items():
                if definitions.setdefault(key, definition) != definition:
                    raise ValueError(f"tools: two tools define ${key} differently; a required tool_choice needs one "
                                     "definition of each")
            calls.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                          "properties": {"name": {"enum": [name]}, "parameters": {
                              key: value for key, value in schema.items() if key != "$defs"}}})
        one_or_more = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if self.parallel_tool_calls is False:
            one_or_more["maxItems"] = 1
        if definitions:
            one_or_more["$defs"] = definitions
        return StructuredOutputsParams(json=one_or_more, disable_any_whitespace=True)


class TokenizeRequest(OpenAIRequest):
    """Either a text `prompt` or chat `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None  # with messages: rendered as a chat request's are

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]


# ------------------------------------------------------------------------------------------------------------
# Responses


def _now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # null: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token's entry at a prompt position (vLLM's form of `prompt_logprobs`)."""

    logprob: float
    rank: int  # 1 = the likeliest
    decoded_token: str | None


# Per prompt position: null for the first (nothing predicts it), else token id -> its entry, for the prompt's own
# token and the top `prompt_logprobs` ones.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended the sample (vLLM's extra)
    prompt_logprobs: PromptLogprobs | None = None  # its prompt's, when asked for (vLLM's extra)


class CompletionResponse(BaseModel):
    """A whole completion, or (streaming) one chunk of it: OpenAI uses the same object for both."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # when asked for (vLLM's extra)


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed call: its first carries the id, type and name; later ones more of the arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "liteinfer"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
