"""`LLM`: offline batch generation, the vLLM way."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceABC

from tqdm.auto import tqdm

from liteinfer.config import EngineConfig
from liteinfer.engine import LLMEngine
from liteinfer.engine.llm_engine import PromptType
from liteinfer.outputs import RequestOutput
from liteinfer.sampling import SamplingParams

Message = dict[str, str]


class LLM:
    """A thin facade over `LLMEngine`: submit every prompt, step until all are done, return in prompt order."""

    def __init__(self, model: str | None = None, **engine_options):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._request_ids = itertools.count()

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        # Every request is checked before any is queued, so one bad prompt leaves nothing behind.
        checked = []
        for prompt, params in zip(prompts, params_list):
            text, token_ids = self.engine.validate_request(prompt, params)
            checked.append({"prompt": text, "prompt_token_ids": token_ids})

        request_ids = [f"gen-{next(self._request_ids)}" for _ in prompts]
        for request_id, prompt, params in zip(request_ids, checked, params_list):
            self.engine.add_request(request_id, prompt, params)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generate", disable=not use_tqdm) as progress:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        progress.update(1)
        return [finished[request_id] for request_id in request_ids]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.apply_chat_template(conversation, add_generation_prompt)}
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[Message], add_generation_prompt: bool = True) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with plain prompts")
        text = self.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        # The template already writes any BOS it wants; letting the tokenizer add another would double it.
        return self.tokenizer.encode(text, add_special_tokens=False)
