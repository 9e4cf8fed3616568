"""The OpenAI-compatible HTTP server: FastAPI routes over one `AsyncLLM`, SSE streaming, OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterator, Sequence
from contextlib import aclosing, asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from liteinfer import __version__
from liteinfer.engine.async_llm import AsyncLLM, EngineOverloadedError, StreamEvent
from liteinfer.engine.llm_engine import PromptType, truncated_prompt
from liteinfer.engine.workers import freeze_startup_objects
from liteinfer.entrypoints.openai.metrics import ServerMetrics
from liteinfer.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    OpenAIRequest,
    PromptLogprob,
    PromptLogprobs,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
    template_tools,
    tool_call_id,
)
from liteinfer.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser
from liteinfer.outputs import Logprob, PositionLogprobs
from liteinfer.sampling import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                503: "overloaded_error"}
# nginx's "client closed request": nobody reads it, but logs tell it from a served request.
_CLIENT_CLOSED_REQUEST = 499
# The lowest logprob a response carries (vLLM's): a format's excluded tokens have -inf, which JSON cannot hold.
_LOGPROB_FLOOR = -9999.0


class APIError(Exception):
    """An error the client should see, with its HTTP status, in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        error_type = _ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return ErrorResponse(error=ErrorInfo(message=self.message, type=error_type, param=self.param,
                                             code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None,
              tool_call_parser: str | None = None) -> FastAPI:
    """The ASGI app; its lifespan starts and stops `llm`'s engine loop. `tool_call_parser` (vLLM's
    `--tool-call-parser`, with `--enable-auto-tool-choice`) finds the calls in answers to tool_choice "auto"."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with llm:
            yield

    app = FastAPI(title="liteinfer", version=__version__, lifespan=lifespan)
    _add_error_handlers(app)
    server = OpenAIServer(llm, model_name, tool_call_parser)

    app.get("/health")(server.health)
    app.get("/version")(server.version)
    app.get("/metrics")(server.metrics_text)
    # Health and metrics stay open so that probes and scrapers need no key.
    protected = APIRouter(dependencies=[Depends(_bearer_check(api_key))] if api_key else [])
    protected.get("/v1/models")(server.models)
    protected.post("/v1/completions")(server.completions)
    protected.post("/v1/chat/completions")(server.chat_completions)
    protected.post("/tokenize")(server.tokenize)
    protected.post("/detokenize")(server.detokenize)
    app.include_router(protected)
    return app


def serve(model: str | None, host: str, port: int, api_key: str | None = None,
          served_model_name: str | None = None, tool_call_parser: str | None = None,
          **async_llm_options: Any) -> None:
    """Take the address, load the model, then serve it until interrupted (what `liteinfer serve` runs)."""
    # Bound before the model loads, as vLLM does: a port in use fails in a moment, not after the load.
    with _bound_socket(host, port) as listener:
        llm = AsyncLLM(model, **async_llm_options)
        app = build_app(llm, served_model_name or llm.engine.config.model, api_key, tool_call_parser)
        freeze_startup_objects()  # `liteinfer serve` is a process of our own
        # Open streams get a few seconds to finish on shutdown; the rest are aborted with the engine loop. The server
        # raises the Ctrl-C it has shut down on once more, which ends the command as `uvicorn.run` does, quietly.
        with suppress(KeyboardInterrupt):
            uvicorn.Server(uvicorn.Config(app, timeout_graceful_shutdown=5)).run(sockets=[listener])


def _bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), as uvicorn binds one; OSError naming the address if it cannot be."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
    except (OSError, OverflowError) as e:
        raise OSError(f"cannot listen on {host}:{port}: {e}") from e
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
    except OSError as e:
        listener.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    return listener


class OpenAIServer:
    """The route handlers, over one `AsyncLLM` serving one model."""

    def __init__(self, llm: AsyncLLM, model_name: str, tool_call_parser: str | None = None):
        self.llm = llm
        self.model_name = model_name
        self.metrics = ServerMetrics(llm)
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool call parser {tool_call_parser!r}; parsers: {', '.join(TOOL_PARSERS)}")
        self.tool_parser = None if tool_call_parser is None else TOOL_PARSERS[tool_call_parser]()

    async def health(self) -> Response:
        if not self.llm.is_running:
            return APIError(503, "the engine loop is not running").response()
        return JSONResponse({"status": "ok"})

    async def version(self) -> dict:
        return {"version": __version__}

    async def metrics_text(self) -> Response:
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.llm.max_model_len)])

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self._check_model(body.model)
        with _user_errors(body):
            if body.messages is not None:
                conversation = [message.as_template_message() for message in body.messages]
                tokens = await self.llm.apply_chat_template(conversation, body.add_generation_prompt,
                                                            body.continue_final_message, body.chat_template_kwargs,
                                                            template_tools(body.tools))
            else:
                tokens = await self.llm.tokenize(body.prompt, body.add_special_tokens)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=self.llm.max_model_len)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(body.model)
        with _user_errors(body):
            return DetokenizeResponse(prompt=await self.llm.detokenize(body.tokens))

    # ----------------------------------------------------------------------------------------------------------
    # Completions

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        num_top = body.logprobs
        # As vLLM: echo with max_tokens 0 gives the prompt alone (its logprobs, what a harness scores); the engine
        # still samples the one token it must, which the response leaves out (the usage counts it, as vLLM's does).
        prompt_only = body.echo and body.max_tokens == 0
        max_tokens = 1 if prompt_only else body.max_tokens
        with _user_errors(body):
            params = body.sampling_params(self.llm.engine.sampling_defaults, max_tokens, num_top,
                                          num_top if body.echo else None)
            prompts = body.prompts()
            keep = params.truncate_prompt_tokens
            echoes = [await self._echo(prompt, keep) for prompt in prompts] if body.echo else None
        if echoes is not None:  # tokenized already: the engine takes the ids
            prompts = [{"prompt": prompt if isinstance(prompt, str) else None, "prompt_token_ids": echo.token_ids}
                       for prompt, echo in zip(prompts, echoes, strict=True)]
        batch = await self._submit("cmpl", body, prompts, params, max_tokens_given=body.max_tokens is not None)
        echo_of = None if echoes is None else dict(zip(batch.request_ids, echoes, strict=True))  # by request id

        def choice(index: int, request_id: str, text: str, token_ids: list[int],
                   positions: list[PositionLogprobs] | None, offset: int, finish_reason: str | None,
                   stop_reason: str | int | None, echo: bool = False) -> CompletionChoice:
            first_token = None
            if prompt_only:
                text, token_ids, positions = "", [], None if positions is None else []
            if echo and echo_of is not None:  # the prompt first: its text, its tokens' logprobs before the choice's
                prompt = echo_of[request_id]
                text, token_ids, first_token = prompt.text + text, prompt.token_ids + token_ids, prompt.first_token
                if num_top is not None:
                    positions = batch.prompt_logprobs[request_id] + positions
            return CompletionChoice(
                index=index, text=text, finish_reason=finish_reason, stop_reason=stop_reason,
                logprobs=None if num_top is None else _completion_logprobs(token_ids, positions, num_top, offset,
                                                                           first_token),
                prompt_logprobs=prompt_logprobs(request_id),
            )

        def prompt_logprobs(request_id: str) -> PromptLogprobs | None:
            if body.prompt_logprobs is None or body.stream:
                return None
            # An echo with more logprobs than the field asks for made the engine compute more: its ids trim them.
            own_ids = None if echo_of is None else echo_of[request_id].token_ids
            return _prompt_logprobs(batch.prompt_logprobs[request_id], body.prompt_logprobs, own_ids)

        if body.stream:
            started: set[int] = set()  # the choices whose first chunk (with the prompt, if echoed) has gone out

            def chunk(event: StreamEvent, index: int) -> CompletionResponse:
                first = index not in started
                started.add(index)
                offset = len(event.text) - len(event.delta)
                if echo_of is not None:  # the choice's text starts with the prompt's
                    offset = 0 if first else offset + len(echo_of[event.request_id].text)
                return batch.completion(choices=[choice(index, event.request_id, event.delta, event.new_token_ids,
                                                        event.logprobs, offset, event.finish_reason,
                                                        event.stop_reason, echo=first)])

            return batch.stream(chunk, lambda usage: batch.completion(choices=[], usage=usage), body.include_usage)

        samples = await self._collect(batch, request)
        if samples is None:
            return Response(status_code=_CLIENT_CLOSED_REQUEST)
        choices = [choice(i, s.request_id, s.text, s.token_ids, s.logprobs, 0, s.finish_reason, s.stop_reason, True)
                   for i, s in enumerate(samples)]
        return JSONResponse(batch.completion(choices=choices, usage=batch.usage.total()).model_dump())

    async def _echo(self, prompt: PromptType, keep: int | None) -> _Echo:
        """What an echoing completion puts first: the prompt's text (a token prompt's, or a truncated one's, decoded),
        and its tokens (the last `keep`: truncate_prompt_tokens)."""
        token_ids = await self.llm.tokenize(prompt) if isinstance(prompt, str) else prompt["prompt_token_ids"]
        kept = truncated_prompt(token_ids, keep, self.llm.engine.max_model_len)
        text = prompt if isinstance(prompt, str) and kept == token_ids else await self.llm.detokenize(kept)
        return _Echo(text, kept, await self.llm.detokenize(kept[:1]))

    # ----------------------------------------------------------------------------------------------------------
    # Chat completions

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        if body.tool_choice == "auto" and body.tools and self.tool_parser is None:
            raise APIError(400, 'tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                                '--tool-call-parser (or give tool_choice "none", "required" or a named function)',
                           param="tool_choice")
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        with _user_errors(body):
            params = body.sampling_params(self.llm.engine.sampling_defaults, max_tokens, num_top)
            prompt = {"prompt_token_ids": await self.llm.apply_chat_template(
                body.conversation(), body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs,
                template_tools(body.tools),
            )}
        try:
            batch = await self._submit("chatcmpl", body, [prompt], params, max_tokens_given=max_tokens is not None)
        except APIError as error:
            if body.tool_choice in ("auto", "none") or error.param != "structured_outputs":
                raise
            # The format is the tools' schemas (protocol.py): the client's field is tools.
            raise APIError(400, f"tools: a tool's parameters do not compile into the calls' format: "
                                f"{error.message.removeprefix('structured_outputs: ')}", param="tools") from error

        def logprobs(token_ids: list[int], positions: list[PositionLogprobs] | None) -> ChatLogprobs | None:
            return None if num_top is None else _chat_logprobs(token_ids, positions, num_top)

        if body.stream:
            answers: dict[int, _StreamedAnswer] = {}

            def chunk(event: StreamEvent, index: int) -> ChatCompletionChunk | None:
                answer = answers.setdefault(index, _StreamedAnswer(body, self.tool_parser))
                delta, finish_reason = answer.add(event.delta, event.finish_reason)
                choice_logprobs = logprobs(event.new_token_ids, event.logprobs)
                if delta == ChatDelta() and finish_reason is None and choice_logprobs is None:
                    return None  # text held back (a call being written): nothing to send yet
                choice = ChatChunkChoice(index=index, delta=delta, logprobs=choice_logprobs,
                                         finish_reason=finish_reason, stop_reason=event.stop_reason)
                return batch.chat_chunk(choices=[choice])

            # As OpenAI does, each choice opens with the assistant's role before any token is ready.
            first = [batch.chat_chunk(choices=[ChatChunkChoice(index=i, delta=ChatDelta(role="assistant",
                                                                                        content=""))])
                     for i in range(params.n)]
            return batch.stream(chunk, lambda usage: batch.chat_chunk(choices=[], usage=usage), body.include_usage,
                                first)

        samples = await self._collect(batch, request)
        if samples is None:
            return Response(status_code=_CLIENT_CLOSED_REQUEST)
        choices = []
        for i, sample in enumerate(samples):
            message, finish_reason = _answer(body, self.tool_parser, sample.text, sample.finish_reason)
            choices.append(ChatChoice(index=i, message=message, logprobs=logprobs(sample.token_ids, sample.logprobs),
                                      finish_reason=finish_reason, stop_reason=sample.stop_reason))
        response = ChatCompletionResponse(
            id=batch.id, created=batch.created, model=self.model_name, choices=choices, usage=batch.usage.total(),
            prompt_logprobs=None if body.prompt_logprobs is None else _prompt_logprobs(
                batch.prompt_logprobs[batch.request_ids[0]], body.prompt_logprobs),
        )
        return JSONResponse(response.model_dump())

    # ----------------------------------------------------------------------------------------------------------
    # Shared

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")

    async def _submit(self, prefix: str, body: OpenAIRequest, prompts: list[PromptType], params: SamplingParams,
                      max_tokens_given: bool) -> _Batch:
        """Queue the call's requests. As vLLM's server, a max_tokens the request gives must fit the context with its
        prompt; the model's recommended one, like none, ends the output where the context does."""
        batch_id = f"{prefix}-{uuid.uuid4().hex}"
        request_ids = [f"{batch_id}-{i}" for i in range(len(prompts))]
        arrival = time.monotonic()
        with _user_errors(body):
            events = await self.llm.submit(prompts, params, request_ids, max_tokens_must_fit=max_tokens_given)
        return _Batch(batch_id, self.model_name, params.n, request_ids, self.metrics.track(events, arrival))

    async def _collect(self, batch: _Batch, request: Request) -> list[_Sample] | None:
        """Every sample's final result in choice order; None if the client left first (its requests aborted)."""
        samples = [_Sample() for _ in range(len(batch.request_ids) * batch.n)]

        async def collect() -> list[_Sample]:
            async with aclosing(batch.events) as events:
                async for event in events:
                    if event.error is not None:
                        raise APIError(500, f"the request failed: {event.error}")
                    batch.record(event)
                    samples[batch.choice_index(event)].add(event)
            return samples

        return await _unless_disconnected(request, collect())


def _answer(body: ChatCompletionRequest, parser: ToolParser | None, text: str,
            finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
    """A whole choice's message and finish reason, as the request's tool_choice reads its text (vLLM's rules): a
    named function's arguments; "required"'s calls (finish "tool_calls"); "auto"'s calls, if the parser finds any
    (finish "tool_calls"); otherwise the text as content."""
    if body.chosen_tool is not None:
        call = ToolCall(function=FunctionCall(name=body.chosen_tool, arguments=text))
        return AssistantMessage(content="", tool_calls=[call]), finish_reason
    calls = None
    if body.tool_choice == "required":
        calls = _required_calls(text)
        content = ""
    elif body.tool_choice == "auto" and parser is not None:
        parsed = parser.parse(text)
        calls = [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.tool_calls]
        if body.parallel_tool_calls is False:  # one call at most, as vLLM keeps it
            calls = calls[:1]
        content = parsed.content
    if not calls:  # none found, or cut short by max_tokens before "required"'s JSON ended
        return AssistantMessage(content=text), finish_reason
    return AssistantMessage(content=content, tool_calls=calls), ("tool_calls" if finish_reason == "stop"
                                                                 else finish_reason)


def _required_calls(text: str) -> list[ToolCall] | None:
    """The calls of a "required" answer, a JSON array of {"name", "parameters"} (its format keeps it so); None for
    one cut short."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [ToolCall(function=FunctionCall(name=call["name"], arguments=json.dumps(call["parameters"],
                                                                                    ensure_ascii=False)))
            for call in calls]


@dataclass
class _StreamedAnswer:
    """One streamed choice, read as the request's tool_choice says: a named function's arguments stream as they
    come; "auto"'s text streams as far as it is surely content (the parser says), its calls come whole at the end;
    "required"'s calls come whole at the end."""

    body: ChatCompletionRequest
    parser: ToolParser | None
    text: str = ""
    num_sent: int = 0  # characters of "auto"'s text sent as content
    call_started: bool = False  # a named function's call: its id and name sent

    def add(self, delta: str, finish_reason: str | None) -> tuple[ChatDelta, str | None]:
        """The chunk's delta and finish reason for the next piece of text (`finish_reason` set: the last)."""
        body = self.body
        self.text += delta
        if body.chosen_tool is not None:
            if self.call_started:
                return ChatDelta(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))]
                                 if delta else None), finish_reason
            self.call_started = True
            call = DeltaToolCall(index=0, id=tool_call_id(), type="function",
                                 function=DeltaFunctionCall(name=body.chosen_tool, arguments=delta))
            return ChatDelta(tool_calls=[call]), finish_reason
        if body.tool_choice not in ("auto", "required") or (body.tool_choice == "auto" and self.parser is None):
            return ChatDelta(content=delta or None), finish_reason
        if finish_reason is None:
            if body.tool_choice == "required":
                return ChatDelta(), None
            end = self.parser.content_end(self.text)
            content, self.num_sent = self.text[self.num_sent : end], max(end, self.num_sent)
            return ChatDelta(content=content or None), None
        message, finish_reason = _answer(body, self.parser, self.text, finish_reason)
        rest = (message.content or "")[self.num_sent :] if message.tool_calls else self.text[self.num_sent :]
        calls = [DeltaToolCall(index=i, id=call.id, type="function",
                               function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments))
                 for i, call in enumerate(message.tool_calls)]
        return ChatDelta(content=rest or None, tool_calls=calls or None), finish_reason


@dataclass(frozen=True)
class _Echo:
    """A prompt as an echoing completion repeats it."""

    text: str  # a token prompt's decoded
    token_ids: list[int]
    first_token: str  # the first token's text (its logprob is null: nothing predicts it)


@dataclass
class _Sample:
    """One choice of a response, accumulated from its events."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, event: StreamEvent) -> None:
        self.request_id, self.text, self.token_ids = event.request_id, event.text, event.token_ids
        self.logprobs += event.logprobs or []
        self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason


@dataclass
class _UsageTally:
    prompt_tokens: dict[str, int] = field(default_factory=dict)  # per request: a prompt counts once for n samples
    completion_tokens: int = 0

    def add(self, event: StreamEvent) -> None:
        self.prompt_tokens[event.request_id] = event.num_prompt_tokens
        self.completion_tokens += len(event.new_token_ids)

    def total(self) -> Usage:
        prompt_tokens = sum(self.prompt_tokens.values())
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=prompt_tokens + self.completion_tokens)


@dataclass
class _Batch:
    """The requests of one API call (one per prompt, each with n samples) and their merged events."""

    id: str
    model: str
    n: int
    request_ids: list[str]
    events: AsyncGenerator[StreamEvent, None]
    created: int = field(default_factory=lambda: int(time.time()))
    usage: _UsageTally = field(default_factory=_UsageTally)
    prompt_logprobs: dict[str, list[PositionLogprobs | None]] = field(default_factory=dict)  # by request, if asked

    def choice_index(self, event: StreamEvent) -> int:
        return self.request_ids.index(event.request_id) * self.n + event.index

    def record(self, event: StreamEvent) -> None:
        """What the response as a whole needs of an event: its tokens for the usage, and the prompt's logprobs."""
        self.usage.add(event)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs[event.request_id] = event.prompt_logprobs

    def completion(self, **fields: Any) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, **fields)

    def chat_chunk(self, **fields: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, **fields)

    def stream(
        self,
        chunk: Callable[[StreamEvent, int], BaseModel | None],
        usage_chunk: Callable[[Usage], BaseModel],
        include_usage: bool,
        first: Sequence[BaseModel] = (),
    ) -> StreamingResponse:
        """Server-sent events: `first`, a chunk per event, the usage if asked for, then `data: [DONE]`. A client
        that disconnects cancels the response's task, which closes the events and so aborts the requests."""

        async def sse() -> AsyncIterator[str]:
            try:
                for data in first:
                    yield _sse(data)
                async with aclosing(self.events) as events:
                    async for event in events:
                        if event.error is not None:
                            yield _sse(APIError(500, f"the request failed: {event.error}").body())
                            continue
                        self.record(event)
                        # A token whose text is held back (half a character, a possible stop string) and whose
                        # logprobs nobody asked for has nothing to show.
                        if (event.delta or event.finished or event.logprobs) and (
                                data := chunk(event, self.choice_index(event))) is not None:
                            yield _sse(data)
                if include_usage:
                    yield _sse(usage_chunk(self.usage.total()))
            except Exception:  # the status line is sent already: report in the stream, keep the server up
                logger.exception("streaming %s failed", self.id)
                yield _sse(APIError(500, "internal server error").body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _sse(data: BaseModel | dict) -> str:
    payload = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"data: {payload}\n\n"


# ------------------------------------------------------------------------------------------------------------
# Logprobs in OpenAI's two formats


def _top(position: PositionLogprobs, k: int) -> list[Logprob]:
    return sorted(position.values(), key=lambda logprob: logprob.rank)[:k]


def _on_the_wire(logprob: float) -> float:
    """A logprob as JSON can carry it (see _LOGPROB_FLOOR)."""
    return max(logprob, _LOGPROB_FLOOR)


def _chosen_and_top(position: PositionLogprobs, token_id: int, k: int) -> dict[str, float]:
    """A legacy completion's top_logprobs at one position: the chosen token, then the top k (OpenAI's: "up to
    logprobs + 1 elements"), by their text."""
    chosen = position[token_id]
    return {lp.decoded_token or "": _on_the_wire(lp.logprob) for lp in [chosen, *_top(position, k)]}


def _completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None], k: int, offset: int,
                         first_token: str | None = None) -> CompletionLogprobs:
    """`positions[i]` holds token_ids[i]'s logprob; None for an echoed prompt's first token, whose text is
    `first_token`."""
    out = CompletionLogprobs()
    for token_id, position in zip(token_ids, positions):
        if position is None:
            out.tokens.append(first_token or "")
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(first_token or "")
            continue
        chosen = position[token_id]
        out.tokens.append(chosen.decoded_token or "")
        out.token_logprobs.append(chosen.logprob)
        out.top_logprobs.append(_chosen_and_top(position, token_id, k))
        out.text_offset.append(offset)
        offset += len(chosen.decoded_token or "")
    return out


def _prompt_logprobs(positions: list[PositionLogprobs | None], k: int,
                     prompt_token_ids: list[int] | None = None) -> PromptLogprobs:
    """The engine's prompt logprobs, computed at top count `k`, in vLLM's wire form. Computed at a larger one (for an
    echo), each position keeps its own prompt token (from `prompt_token_ids`) and the top `k`."""
    own = prompt_token_ids or [None] * len(positions)
    return [None if position is None else {
        token_id: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
        for token_id, lp in position.items() if prompt_token_ids is None or lp.rank <= k or token_id == own_id
    } for position, own_id in zip(positions, own, strict=True)]


def _chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], k: int) -> ChatLogprobs:
    def fields(logprob: Logprob) -> dict:
        token = logprob.decoded_token or ""
        return {"token": token, "logprob": _on_the_wire(logprob.logprob), "bytes": list(token.encode())}

    return ChatLogprobs(content=[
        TokenLogprob(**fields(position[token_id]), top_logprobs=[TopLogprob(**fields(lp)) for lp in _top(position, k)])
        for token_id, position in zip(token_ids, positions)
    ])


# ------------------------------------------------------------------------------------------------------------
# Errors, authentication, disconnects


@contextmanager
def _user_errors(body: OpenAIRequest) -> Iterator[None]:
    """The client's mistakes as 400s (naming the field when the message starts with it), overload as 503."""
    try:
        yield
    except EngineOverloadedError as exc:
        raise APIError(503, str(exc)) from exc
    except ValueError as exc:  # a template's refusal included (engine/prompts.py: render_chat)
        first_word = str(exc).split(" ", 1)[0].rstrip(":")
        raise APIError(400, str(exc), param=first_word if first_word in type(body).model_fields else None) from exc


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = exc.errors()[0]
        if error["type"] == "json_invalid":
            return APIError(400, f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}"
                            ).response()
        location = [str(part) for part in error["loc"] if part != "body"]
        if not location and error["type"] == "value_error":  # a check of the whole request (protocol.py) refused it
            return APIError(400, str(error["ctx"]["error"])).response()
        if not location:  # the body as a whole: not an object, or not sent as JSON
            return APIError(400, "the body must be a JSON object, sent as Content-Type: application/json").response()
        param = ".".join(location)
        return APIError(400, f"{param}: {error['msg']}", param=param).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return APIError(500, "internal server error").response()


def _bearer_check(api_key: str) -> Callable[[Request], Coroutine[Any, Any, None]]:
    async def check(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")

    return check


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """Run `work`, cancelling it if the client disconnects first (then None)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None
