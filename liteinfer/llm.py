"""`LLM`: offline batch generation, the vLLM way."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from liteinfer.config import EngineConfig
from liteinfer.engine.data_parallel import make_engine
from liteinfer.engine.llm_engine import PromptType
from liteinfer.engine.prompts import Message, check_all, final_outputs_only, pair_prompts, render_chat
from liteinfer.outputs import RequestOutput
from liteinfer.sampling import SamplingParams


class LLM:
    """A thin facade over `LLMEngine`: submit every prompt, step until all are done, return in prompt order."""

    def __init__(self, model: str | None = None, **engine_options):
        self.engine = make_engine(EngineConfig.from_kwargs(model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._request_ids = itertools.count()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the engine's worker processes or replicas, if it has any (also done at interpreter exit)."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        requests = check_all(self.engine, final_outputs_only(pair_prompts(prompts, sampling_params,
                                                                          self.get_default_sampling_params())))
        request_ids = [f"gen-{next(self._request_ids)}" for _ in requests]
        for request_id, (prompt, params) in zip(request_ids, requests):
            self.engine.add_request(request_id, prompt, params)
        unfinished, finished = set(request_ids), {}
        try:
            with tqdm(total=len(requests), desc="generate", disable=not use_tqdm) as progress:
                while unfinished and self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        if output.finished and output.request_id in unfinished:
                            unfinished.discard(output.request_id)
                            finished[output.request_id] = output
                            progress.update(1)
        finally:  # interrupted (Ctrl-C, a failed step): what is left is aborted, not run by the next call unasked
            for request_id in unfinished:
                self.engine.abort_request(request_id)
        return [finished[request_id] for request_id in request_ids]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the model's chat template
        (`apply_chat_template` for the options). The replies are the model's text, calls of `tools` included as it
        writes them (the server's tool parsers make them OpenAI's tool_calls)."""
        if not isinstance(messages, list):
            raise ValueError(f"messages is a conversation (a list of messages) or a list of them, got "
                             f"{type(messages).__name__}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        # The rendered text comes with the ids, as the outputs' `prompt` (vLLM's).
        prompts = [render_chat(self.tokenizer, conversation, add_generation_prompt, continue_final_message,
                               chat_template_kwargs, tools) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: the model's recommended sampling
        (its generation_config.json; the `generation_config` option), else SamplingParams' defaults."""
        return self.engine.default_sampling_params()

    def apply_chat_template(
        self,
        conversation: list[Message],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """A conversation's prompt token ids: the assistant's turn opened (`add_generation_prompt`) or the last
        message left open to be continued (`continue_final_message`); `chat_template_kwargs` are further variables
        of the template (Qwen3's `enable_thinking`, ...); `tools`, the functions the model may call."""
        return render_chat(self.tokenizer, conversation, add_generation_prompt, continue_final_message,
                           chat_template_kwargs, tools)["prompt_token_ids"]
