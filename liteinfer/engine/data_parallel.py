"""Data parallelism: N engine replicas as Ray actors behind one request interface (the optional `ray` extra).

`DataParallelEngine` answers to what `LLM` and `AsyncLLM` ask of an `LLMEngine` — `add_request`, `step`,
`abort_request`, `has_unfinished_requests`, `validate_request`, `tokenizer`, `max_model_len` — so both front ends
(and through `AsyncLLM`, `liteinfer serve`) run unchanged over several replicas. Each replica is a whole engine
(with its own tensor-parallel ranks when `tensor_parallel_size` > 1) in a Ray actor, on this machine or any node
of the cluster at `ray_address` (None starts a local one).

- A new request goes to the live replica with the fewest unfinished requests (least loaded).
- `step` keeps one engine step in flight on every replica with work and returns the outputs of whichever
  finishes first, so replicas never wait for one another.
- A replica that dies is logged, and each of its unfinished requests is retried once, from its prompt, on another
  replica. A retry repeats the tokens already produced only when sampling is reproducible (greedy or seeded); so a
  request that has shown tokens is retried only then (outputs are held back until the retry has caught up), and
  otherwise ends with `error` set and finish_reason "abort" — as does a request whose retry fails too. None is
  lost silently.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from liteinfer.config import EngineConfig
from liteinfer.engine.llm_engine import EngineStats, LLMEngine, PromptType
from liteinfer.engine.workers import freeze_startup_objects
from liteinfer.models.source import load_config, load_tokenizer, resolve_model, sampling_defaults, tokenizer_source
from liteinfer.outputs import CompletionOutput, RequestOutput
from liteinfer.sampling import GrammarMatchers, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


def _ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError("data_parallel_size > 1 runs replicas on Ray: pip install 'liteinfer[ray]'") from e
    return ray


def make_engine(config: EngineConfig) -> LLMEngine | DataParallelEngine:
    """One engine, or with data_parallel_size > 1 its replicas on Ray behind the same interface."""
    return DataParallelEngine(config) if config.data_parallel_size > 1 else LLMEngine(config)


class _Replica:
    """One engine in a Ray actor; its methods run one at a time, in the order a caller sent them."""

    def __init__(self, config: EngineConfig):
        self.engine = LLMEngine(config)
        freeze_startup_objects()  # the actor's process is ours

    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> None:
        self.engine.add_request(request_id, prompt, params)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return self.engine.abort_request(request_id)

    def step(self) -> tuple[list[RequestOutput], EngineStats]:
        return self.engine.step(), self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()


@dataclass(eq=False)
class _ReplicaHandle:
    index: int
    actor: Any  # ray.actor.ActorHandle of a _Replica
    alive: bool = True
    requests: set[str] = field(default_factory=set)  # unfinished requests it holds
    step_in_flight: Any = None  # ObjectRef of its running step
    stats: EngineStats = field(default_factory=EngineStats)  # as of its last step


@dataclass
class _Tracked:
    """What the front end keeps of a request: enough to send it again."""

    prompt: dict[str, Any]  # validated: {"prompt": text or None, "prompt_token_ids": [...]}
    params: SamplingParams
    replica: _ReplicaHandle
    retried: bool = False
    tokens_shown: int = 0  # output tokens (over all samples) in the last output handed out
    last_output: RequestOutput | None = None
    # A DELTA request runs cumulative on its replica (a retry is matched against what was shown): per sample, the
    # tokens and characters handed out so far.
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def replica_params(self) -> SamplingParams:
        if self.params.output_kind is RequestOutputKind.DELTA:
            return replace(self.params, output_kind=RequestOutputKind.CUMULATIVE)
        return self.params

    def for_caller(self, output: RequestOutput) -> RequestOutput:
        """A replica's output as the request's kind asks: for DELTA, what each sample has not handed out before (the
        prompt's logprobs in the first output only)."""
        if self.params.output_kind is not RequestOutputKind.DELTA:
            return output
        prompt_logprobs = None if self.sent else output.prompt_logprobs
        samples = []
        for sample in output.outputs:
            tokens, chars = self.sent.get(sample.index, (0, 0))
            self.sent[sample.index] = (len(sample.token_ids), len(sample.text))
            samples.append(replace(sample, text=sample.text[chars:], token_ids=sample.token_ids[tokens:],
                                   logprobs=None if sample.logprobs is None else sample.logprobs[tokens:]))
        return replace(output, outputs=samples, prompt_logprobs=prompt_logprobs)


class DataParallelEngine:
    # The same checks, over tokenizer, hf_config, eos_token_ids, grammars and max_model_len.
    validate_request = LLMEngine.validate_request
    _eos_token_ids = LLMEngine._eos_token_ids
    default_sampling_params = LLMEngine.default_sampling_params

    def __init__(self, config: EngineConfig):
        ray = _ray()
        self.config = config
        source = resolve_model(config.model, config.revision)  # converts a GGUF once, here, before the replicas do
        self.hf_config = load_config(source)
        self.tokenizer = load_tokenizer(tokenizer_source(source, config.tokenizer, config.tokenizer_revision))
        self.eos_token_ids = self._eos_token_ids(source)
        self.grammars = GrammarMatchers(self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids)
        self.sampling_defaults = sampling_defaults(source, config.generation_config)
        if not ray.is_initialized():
            ray.init(address=config.ray_address, include_dashboard=False)
        replica_config = replace(config, data_parallel_size=1)
        on_gpu = config.torch_device().type == "cuda"
        resources = {"num_gpus": config.tensor_parallel_size} if on_gpu else {"num_cpus": 1}
        actor_class = ray.remote(**resources)(_Replica)
        self.replicas = [
            _ReplicaHandle(i, actor_class.remote(replica_config))
            for i in range(config.data_parallel_size)
        ]
        # Every replica loaded (or its error raised here) before the first request.
        self.max_model_len = min(ray.get([r.actor.max_model_len.remote() for r in self.replicas]))
        self.requests: dict[str, _Tracked] = {}

    # Requests --------------------------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or self.default_sampling_params()
        text, token_ids = self.validate_request(prompt, params)
        replica = self._least_loaded()
        self.requests[request_id] = _Tracked({"prompt": text, "prompt_token_ids": token_ids}, params, replica)
        self._send(replica, request_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        tracked = self.requests.pop(request_id, None)
        if tracked is None:
            return None
        tracked.replica.requests.discard(request_id)
        try:
            output = _ray().get(tracked.replica.actor.abort_request.remote(request_id))
        except _ray().exceptions.RayActorError:
            output = None
        return self._failed(request_id, tracked, "aborted") if output is None else tracked.for_caller(output)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        """The replicas' load summed (KV usage averaged), as of each one's last step."""
        live = [r.stats for r in self.replicas if r.alive] or [EngineStats()]
        return EngineStats(sum(s.num_running_seqs for s in live), sum(s.num_waiting_seqs for s in live),
                           sum(s.kv_cache_usage for s in live) / len(live),
                           sum(s.prefix_cache_queried_tokens for s in live),
                           sum(s.prefix_cache_hit_tokens for s in live), sum(s.spec_draft_tokens for s in live),
                           sum(s.spec_accepted_tokens for s in live))

    # The loop --------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """The outputs of the next replica step to finish (waits for one)."""
        ray = _ray()
        for replica in self.replicas:
            if replica.alive and replica.requests and replica.step_in_flight is None:
                replica.step_in_flight = replica.actor.step.remote()
        in_flight = {r.step_in_flight: r for r in self.replicas if r.step_in_flight is not None}
        if not in_flight:
            return []
        done, _ = ray.wait(list(in_flight), num_returns=1)
        outputs: list[RequestOutput] = []
        for ref in done:
            replica = in_flight[ref]
            replica.step_in_flight = None
            try:
                step_outputs, replica.stats = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                outputs += self._replica_died(replica, exc)
                continue
            outputs += [out for out in map(self._deliver, step_outputs) if out is not None]
        return outputs

    def shutdown(self) -> None:
        ray = _ray()
        for replica in self.replicas:
            if replica.alive:
                replica.alive = False
                with contextlib.suppress(ray.exceptions.RayActorError):
                    ray.get(replica.actor.shutdown.remote())
                ray.kill(replica.actor)

    # Internals -------------------------------------------------------------------------------------------------

    def _least_loaded(self, excluding: _ReplicaHandle | None = None) -> _ReplicaHandle:
        live = [r for r in self.replicas if r.alive and r is not excluding]
        if not live:
            raise RuntimeError("every data-parallel replica has died")
        return min(live, key=lambda r: len(r.requests))

    def _send(self, replica: _ReplicaHandle, request_id: str) -> None:
        tracked = self.requests[request_id]
        tracked.replica = replica
        replica.requests.add(request_id)
        # Not awaited: the prompt was validated here, and the actor runs it before the step sent after it.
        replica.actor.add_request.remote(request_id, tracked.prompt, tracked.replica_params)

    def _deliver(self, output: RequestOutput) -> RequestOutput | None:
        tracked = self.requests.get(output.request_id)
        if tracked is None:  # aborted meanwhile
            return None
        if output.finished:
            del self.requests[output.request_id]
            tracked.replica.requests.discard(output.request_id)
            return tracked.for_caller(output)
        num_tokens = sum(len(sample.token_ids) for sample in output.outputs)
        if num_tokens <= tracked.tokens_shown:  # a retry still repeating what was already shown
            return None
        tracked.tokens_shown, tracked.last_output = num_tokens, output
        return tracked.for_caller(output)

    def _replica_died(self, replica: _ReplicaHandle, exc: BaseException) -> list[RequestOutput]:
        replica.alive = False
        lost = sorted(replica.requests)
        replica.requests.clear()
        logger.error("data-parallel replica %d died (%s); %d unfinished request(s) to retry or fail",
                     replica.index, type(exc).__name__, len(lost))
        failed = []
        for request_id in lost:
            tracked = self.requests[request_id]
            reproducible = tracked.params.temperature == 0 or tracked.params.seed is not None
            if tracked.retried or not (reproducible or tracked.tokens_shown == 0) or not self._any_alive():
                failed.append(self._failed(request_id, tracked, f"its replica {replica.index} died"))
                continue
            tracked.retried = True
            self._send(self._least_loaded(), request_id)
        return failed

    def _any_alive(self) -> bool:
        return any(r.alive for r in self.replicas)

    def _failed(self, request_id: str, tracked: _Tracked, why: str) -> RequestOutput:
        """A final output for a request that cannot finish: what was shown of it, marked aborted, with an error."""
        self.requests.pop(request_id, None)
        shown = tracked.last_output.outputs if tracked.last_output is not None else []
        samples = [replace(sample, finish_reason=sample.finish_reason or "abort") for sample in shown] or [
            CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort") for i in range(tracked.params.n)
        ]
        return tracked.for_caller(RequestOutput(
            request_id=request_id,
            prompt=tracked.prompt["prompt"],
            prompt_token_ids=tracked.prompt["prompt_token_ids"],
            outputs=samples,
            finished=True,
            error=f"request {request_id} failed: {why}",
        ))
