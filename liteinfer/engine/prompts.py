"""What callers hand the engine, made into requests: a batch of prompts paired with their sampling params and
checked as a whole, and chat conversations rendered with the model's template. Shared by `LLM` and `AsyncLLM`."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import jinja2

from liteinfer.engine.llm_engine import LLMEngine, PromptType, encode_text
from liteinfer.sampling import RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # transformers is slow to import and only needed for the annotation
    from transformers import PreTrainedTokenizerBase

Message = dict[str, str]


def pair_prompts(
    prompts: PromptType | SequenceABC[PromptType],
    sampling_params: SamplingParams | SequenceABC[SamplingParams] | None,
    defaults: SamplingParams,
) -> list[tuple[PromptType, SamplingParams]]:
    """One prompt or a list, with one `SamplingParams` for all (None = `defaults`) or one per prompt."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if not isinstance(prompts, Iterable):
        raise ValueError(f"prompts are a prompt or a list of them, got {type(prompts).__name__}")
    prompts = list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [(prompt, sampling_params or defaults) for prompt in prompts]
    params_list = list(sampling_params) if isinstance(sampling_params, Iterable) else [sampling_params]
    if isinstance(sampling_params, dict) or not all(isinstance(params, SamplingParams) for params in params_list):
        raise ValueError(f"sampling params are a SamplingParams or a list of them, one per prompt, got "
                         f"{sampling_params!r:.80}")
    if len(params_list) != len(prompts):
        raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
    return list(zip(prompts, params_list))


def final_outputs_only(requests: list[tuple[PromptType, SamplingParams]]) -> list[tuple[PromptType, SamplingParams]]:
    """The requests reporting their finished outputs only (`RequestOutputKind.FINAL_ONLY`), for a caller that waits
    for those: the engine then builds no output for a running request."""
    return [(prompt, replace(params, output_kind=RequestOutputKind.FINAL_ONLY)) for prompt, params in requests]


def delta_outputs(requests: list[tuple[PromptType, SamplingParams]]) -> list[tuple[PromptType, SamplingParams]]:
    """The requests that report every step (CUMULATIVE, DELTA) reporting what is new each time (DELTA), for a caller
    that adds it up itself: the engine then copies nothing that grows with the output. FINAL_ONLY ones stay so."""
    return [(prompt, params if params.output_kind is RequestOutputKind.FINAL_ONLY
             else replace(params, output_kind=RequestOutputKind.DELTA)) for prompt, params in requests]


def check_all(
    engine: LLMEngine, requests: list[tuple[PromptType, SamplingParams]], max_tokens_must_fit: bool = False
) -> list[tuple[PromptType, SamplingParams]]:
    """Every request validated before any is queued, so one bad prompt leaves nothing behind. Prompts come back
    tokenized, so queuing them does not tokenize twice. `max_tokens_must_fit`: a request whose prompt and max_tokens
    together exceed the context is refused (OpenAI's API and vLLM's server do), not ended where the context ends."""
    checked = []
    for prompt, params in requests:
        text, token_ids = engine.validate_request(prompt, params)
        room = engine.max_model_len - len(token_ids)
        if max_tokens_must_fit and params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"max_tokens is too large: {params.max_tokens}. The context holds {engine.max_model_len} "
                             f"tokens and the prompt has {len(token_ids)}, which leaves {room}")
        checked.append(({"prompt": text, "prompt_token_ids": token_ids}, params))
    return checked


def template_messages(conversation: object) -> list[Message]:
    """A conversation as chat templates read it, or a ValueError saying what is wrong with it (a template fails on
    a malformed message with a jinja2 UndefinedError or a TypeError that does not). Each message needs a string
    `role`; its `content` may be a string, None (empty) or, as OpenAI's API sends it, a list of text parts, which
    are joined by newlines (as vLLM joins them for templates that read a string). Other fields pass through."""
    if not isinstance(conversation, list):
        raise ValueError(f"a conversation is a list of messages, got {type(conversation).__name__}")
    messages = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"message {i} must be a dict with a string 'role', got {message!r:.80}")
        content = message.get("content")
        if isinstance(content, list) and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in content
        ):
            content = "\n".join(part["text"] for part in content)
        if content is not None and not isinstance(content, str):
            raise ValueError(f"message {i}'s content must be a string or a list of text parts, got {content!r:.80}")
        messages.append({**message, "content": content or ""})
    return messages


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[Message],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A conversation as the engine's prompt, `{"prompt": text, "prompt_token_ids": ids}`, rendered with the
    tokenizer's chat template: ending with the assistant's turn opened (`add_generation_prompt`) or with the last
    message left open for the model to go on with (`continue_final_message`). `chat_template_kwargs` are further
    variables the template reads (Qwen3's `enable_thinking`, for one); `tools`, the functions the model may call
    (transformers' form: OpenAI's `{"type": "function", "function": {...}}`), which a template that knows tools
    writes into the prompt. A template that refuses the conversation (alternating roles, ...) raises ValueError
    with its message."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use generate() with plain prompts")
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message leaves the last message open, add_generation_prompt opens a new "
                         "one: set only one of them")
    variables = {} if chat_template_kwargs is None else chat_template_kwargs
    if not isinstance(variables, dict) or not all(isinstance(name, str) for name in variables):
        raise ValueError(f"chat_template_kwargs maps the template's variables by name, got {variables!r:.80}")
    if variables:  # (the signature is read only for a request that sets some)
        # apply_chat_template's own arguments would change how it renders, not what the template reads, and
        # `messages` is the conversation itself.
        own = {name for name, parameter in inspect.signature(tokenizer.apply_chat_template).parameters.items()
               if parameter.kind is not inspect.Parameter.VAR_KEYWORD} | {"messages"}
        if taken := sorted(own & variables.keys()):
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: not variables of the template's "
                             "own")
    messages = template_messages(conversation)
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **variables)
    # The template's raise_exception(...), or a variable of chat_template_kwargs that it cannot use (TypeError:
    # the messages, checked above, cannot cause one).
    except (jinja2.TemplateError, TypeError) as e:
        raise ValueError(f"the chat template refused the conversation: {e}") from e
    # The template already writes any BOS it wants; letting the tokenizer add another would double it.
    return {"prompt": text, "prompt_token_ids": encode_text(tokenizer, text, add_special_tokens=False)}
