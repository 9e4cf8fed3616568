"""`AsyncLLM`: the same `LLMEngine`, driven by one background loop so that asyncio code can stream and cancel.

The engine is not thread-safe, so it is touched from one thread only: a single-worker executor runs every engine
call — steps, adds, aborts, tokenization — one after another, while the event loop stays free. An add or abort
submitted during a step therefore lands between that step and the next. Each submission has one asyncio queue;
the loop puts every `RequestOutput` of its requests there, and the caller's iterator turns them into events.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from collections.abc import Sequence as SequenceABC
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from liteinfer.config import EngineConfig
from liteinfer.engine.data_parallel import make_engine
from liteinfer.engine.llm_engine import EngineStats, PromptType, encode_text
from liteinfer.engine.prompts import Message, check_all, delta_outputs, final_outputs_only, pair_prompts, render_chat
from liteinfer.outputs import FinishReason, PositionLogprobs, RequestOutput
from liteinfer.sampling import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Enough to keep a busy server's batch full; small enough that a flood of requests is refused, not hoarded.
DEFAULT_MAX_WAITING_SEQS = 1024


class EngineOverloadedError(RuntimeError):
    """More sequences would wait for the engine than `max_waiting_seqs` allows; try again later."""


@dataclass(frozen=True)
class StreamEvent:
    """One sample's progress: sent for every step that gives it a new token (with speculative decoding, the tokens
    that step kept: one or more), and once more if it ends without one (abort)."""

    request_id: str
    index: int  # which of the request's n samples
    text: str  # all output text so far
    delta: str  # text new since this sample's previous event
    token_ids: list[int]  # all output token ids so far
    new_token_ids: list[int]  # the ids new since the previous event
    finished: bool  # this sample has ended
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    logprobs: list[PositionLogprobs] | None  # of the new tokens; None unless the params asked for logprobs
    num_prompt_tokens: int
    error: str | None = None  # set when the request failed inside the engine
    # With SamplingParams.prompt_logprobs: the prompt's (RequestOutput.prompt_logprobs), on the events of the output
    # that carries them (the first step's, where the first sample gets its first token; with FINAL_ONLY the only
    # one, an event a sample); else None. As far as computed if the request was aborted before its prompt was.
    prompt_logprobs: list[PositionLogprobs | None] | None = None


class AsyncLLM:
    """`async with AsyncLLM(model, **engine_options) as llm:` — `generate`, `stream`, `submit`, `abort`.

    Requests from any number of tasks share the engine's continuous batch. Leaving an event iterator early,
    cancelling the task that reads it, or `abort(request_id)` ends the request and frees its KV blocks before the
    next step. Past `max_waiting_seqs` queued sequences, new requests raise `EngineOverloadedError` (a submission
    that alone asks for more sequences than that raises `ValueError`: retrying would not help).
    """

    def __init__(
        self, model: str | None = None, *, max_waiting_seqs: int = DEFAULT_MAX_WAITING_SEQS, **engine_options: Any
    ):
        if isinstance(max_waiting_seqs, bool) or not isinstance(max_waiting_seqs, int) or max_waiting_seqs < 1:
            raise ValueError(f"max_waiting_seqs must be an integer >= 1, got {max_waiting_seqs!r}")
        self.engine = make_engine(EngineConfig.from_kwargs(model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.max_waiting_seqs = max_waiting_seqs
        self.stats = EngineStats()
        self.error: BaseException | None = None  # why the loop died, if it did
        self._request_ids = itertools.count()
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> its submission's output queue
        self._executor: ThreadPoolExecutor | None = None
        self._loop_task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._stopping = False

    # ----------------------------------------------------------------------------------------------------------
    # Life cycle

    async def __aenter__(self) -> AsyncLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    async def start(self) -> None:
        if self._loop_task is not None:
            raise RuntimeError("AsyncLLM is already running")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="liteinfer-engine")
        self._wakeup = asyncio.Event()
        self._stopping = False
        self.error = None
        self._loop_task = asyncio.create_task(self._run(), name="liteinfer-engine-loop")

    async def shutdown(self) -> None:
        """Finish the current step, abort every request left (their readers get finish_reason "abort"), stop."""
        if self._loop_task is None:
            return
        self._stopping = True
        self._wakeup.set()
        try:
            await self._loop_task
            self._dispatch(await self._on_engine(self._abort_all))
        finally:
            self._executor.shutdown(wait=False)  # an abort still queued by a closing reader finds nothing to do
            self._executor = self._loop_task = None

    async def _run(self) -> None:
        try:
            while not self._stopping:
                if not self.engine.has_unfinished_requests():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                self._dispatch(await self._on_engine(self._step))
        except Exception as exc:  # a bug or an out-of-memory: every reader must hear of it, not hang
            logger.exception("the engine loop failed")
            self.error = exc
            for queue in set(self._queues.values()):
                queue.put_nowait(exc)
            self._queues.clear()

    # ----------------------------------------------------------------------------------------------------------
    # Requests

    async def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Submit every prompt at once (they are batched together); the final outputs, in prompt order."""
        requests = final_outputs_only(pair_prompts(prompts, sampling_params, self.engine.default_sampling_params()))
        request_ids, queue = await self._submit(requests, None, max_tokens_must_fit=False)
        unfinished, finished = set(request_ids), {}
        try:
            while unfinished:
                output = await self._next_output(queue)
                if output.finished:
                    unfinished.discard(output.request_id)
                    finished[output.request_id] = output
        finally:
            self._release(request_ids, unfinished)
        return [finished[request_id] for request_id in request_ids]

    async def stream(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[StreamEvent]:
        """`async for event in llm.stream(prompt, params)`: one `StreamEvent` per new token of each sample (per step
        with speculative decoding, which may keep several)."""
        events = await self.submit([prompt], sampling_params, None if request_id is None else [request_id])
        async with aclosing(events):
            async for event in events:
                yield event

    async def submit(
        self,
        prompts: SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        request_ids: SequenceABC[str] | None = None,
        max_tokens_must_fit: bool = False,
    ) -> AsyncGenerator[StreamEvent, None]:
        """Queue every prompt now — raising `ValueError` or `EngineOverloadedError` before any is queued — and
        return the events of all of them, in step order. Closing the iterator, or dropping it, aborts the unfinished
        ones, read or not. The params' `output_kind` says which steps send events: FINAL_ONLY only the last one a
        sample; CUMULATIVE and DELTA each step. `max_tokens_must_fit`: refuse a request whose prompt and max_tokens
        exceed the context (a server's rule; otherwise it ends where the context does, finish_reason "length")."""
        requests = delta_outputs(pair_prompts(list(prompts), sampling_params, self.engine.default_sampling_params()))
        ids, queue = await self._submit(requests, request_ids, max_tokens_must_fit)
        events = self._events(ids, queue)
        await anext(events)  # into the `try` that aborts the unfinished, before the caller can close or drop it
        return events

    async def abort(self, request_id: str) -> None:
        """End a request now (its reader gets a last event, finish_reason "abort"); unknown ids are ignored."""
        output = await self._on_engine(self._abort, request_id)
        if output is not None:
            self._dispatch([output])

    async def _submit(
        self, requests: list[tuple[PromptType, SamplingParams]], request_ids: SequenceABC[str] | None,
        max_tokens_must_fit: bool,
    ) -> tuple[list[str], asyncio.Queue]:
        if self.error is not None:
            raise RuntimeError(f"the engine loop has failed: {self.error!r}")
        if request_ids is None:
            request_ids = [f"req-{next(self._request_ids)}" for _ in requests]
        request_ids = list(request_ids)
        if len(request_ids) != len(requests) or len(set(request_ids)) != len(request_ids):
            raise ValueError(f"need {len(requests)} distinct request ids, got {request_ids}")
        if in_use := [request_id for request_id in request_ids if request_id in self._queues]:
            raise ValueError(f"request id(s) {in_use} already in use")
        queue: asyncio.Queue = asyncio.Queue()
        for request_id in request_ids:  # registered first, so that no output can come before its reader
            self._queues[request_id] = queue
        try:
            await self._on_engine(self._add_all, request_ids, requests, max_tokens_must_fit)
        except BaseException as exc:
            for request_id in request_ids:
                self._queues.pop(request_id, None)
                if isinstance(exc, asyncio.CancelledError):  # the add may still have gone through: take it back
                    self._abort_soon(request_id)
            raise
        self._wakeup.set()
        return request_ids, queue

    async def _events(self, request_ids: list[str], queue: asyncio.Queue) -> AsyncGenerator[StreamEvent | None, None]:
        """The events of `submit`'s requests, after a first None that `submit` takes itself: a generator closed or
        dropped before it has started would not run its `finally`."""
        unfinished = set(request_ids)
        progress: dict[tuple[str, int], _SampleProgress] = {}
        try:
            yield None
            while unfinished:
                output = await self._next_output(queue)
                if output.finished:
                    unfinished.discard(output.request_id)
                for event in _new_events(output, progress):
                    yield event
        finally:
            self._release(request_ids, unfinished)

    async def _next_output(self, queue: asyncio.Queue) -> RequestOutput:
        output = await queue.get()
        if isinstance(output, BaseException):
            raise RuntimeError("the engine loop failed") from output
        return output

    def _release(self, request_ids: list[str], unfinished: set[str]) -> None:
        """A submission's reader is done: its queue goes, and requests not finished (the reader left early: break,
        cancel, close, error) are aborted, freeing their blocks."""
        for request_id in request_ids:
            self._queues.pop(request_id, None)
        for request_id in unfinished:
            self._abort_soon(request_id)

    # ----------------------------------------------------------------------------------------------------------
    # Tokenizer work, run on the engine's thread like everything else that uses the tokenizer

    async def apply_chat_template(
        self,
        conversation: list[Message],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """As `LLM.apply_chat_template`."""
        prompt = await self._on_engine(render_chat, self.tokenizer, conversation, add_generation_prompt,
                                       continue_final_message, chat_template_kwargs, tools)
        return prompt["prompt_token_ids"]

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._on_engine(encode_text, self.tokenizer, text, add_special_tokens=add_special_tokens)

    async def detokenize(self, token_ids: list[int]) -> str:
        vocab = self.engine.hf_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in token_ids):
            raise ValueError(f"token ids must be integers in [0, {vocab})")
        return await self._on_engine(self.tokenizer.decode, token_ids)

    # ----------------------------------------------------------------------------------------------------------
    # The engine's thread: only these touch the engine

    async def _on_engine(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._executor is None:
            raise RuntimeError("AsyncLLM is not running: use `async with AsyncLLM(...) as llm:`")
        return await asyncio.get_running_loop().run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def _step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        self._update_stats()
        return outputs

    def _add_all(self, request_ids: list[str], requests: list[tuple[PromptType, SamplingParams]],
                 max_tokens_must_fit: bool) -> None:
        new = sum(params.n for _, params in requests)
        if new > self.max_waiting_seqs:  # not a matter of waiting: this could never be queued
            raise ValueError(f"these prompts ask for {new} sequences (n each), more than max_waiting_seqs="
                             f"{self.max_waiting_seqs} can ever hold waiting; submit fewer at once")
        waiting = self.engine.stats().num_waiting_seqs + new
        if waiting > self.max_waiting_seqs:
            raise EngineOverloadedError(
                f"the engine is overloaded: {waiting} sequences would wait, more than max_waiting_seqs="
                f"{self.max_waiting_seqs}; retry later"
            )
        for request_id, (prompt, params) in zip(request_ids, check_all(self.engine, requests, max_tokens_must_fit)):
            self.engine.add_request(request_id, prompt, params)
        self._update_stats()

    def _abort(self, request_id: str) -> RequestOutput | None:
        output = self.engine.abort_request(request_id)
        self._update_stats()
        return output

    def _abort_all(self) -> list[RequestOutput]:
        return [output for request_id in list(self.engine.requests) if (output := self._abort(request_id))]

    def _update_stats(self) -> None:
        self.stats = self.engine.stats()

    # ----------------------------------------------------------------------------------------------------------
    # Back on the event loop

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
            if output.finished:
                self._queues.pop(output.request_id, None)

    def _abort_soon(self, request_id: str) -> None:
        """Queue an abort without waiting for it (a closing generator cannot wait); it runs before the next step."""
        if self._executor is None:  # shut down: every request has been aborted already
            return
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._abort, request_id)
        future.add_done_callback(_log_failure)


@dataclass
class _SampleProgress:
    """What a sample's events have carried so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False


def _new_events(output: RequestOutput, progress: dict[tuple[str, int], _SampleProgress]) -> list[StreamEvent]:
    """The events of the samples that advanced (or ended) in `output`, whose samples carry what is new since their
    previous output (DELTA; FINAL_ONLY's one output carries everything); `progress` adds it up."""
    events = []
    for sample in output.outputs:
        so_far = progress.setdefault((output.request_id, sample.index), _SampleProgress())
        if not sample.token_ids and not sample.text and sample.finished == so_far.finished:
            continue
        so_far.text += sample.text
        so_far.token_ids = so_far.token_ids + sample.token_ids  # a new list: an earlier event keeps its own
        so_far.finished = sample.finished
        events.append(StreamEvent(
            request_id=output.request_id,
            index=sample.index,
            text=so_far.text,
            delta=sample.text,
            token_ids=so_far.token_ids,
            new_token_ids=sample.token_ids,
            finished=sample.finished,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
            logprobs=sample.logprobs,
            num_prompt_tokens=len(output.prompt_token_ids),
            error=output.error,
            prompt_logprobs=output.prompt_logprobs,
        ))
    return events


def _log_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error("aborting a request failed", exc_info=future.exception())
