"""The engine loop: requests in, one scheduled forward pass per `step`, outputs out."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from liteinfer.cache import BlockManager, KVCache
from liteinfer.config import EngineConfig
from liteinfer.distributed import TensorParallelGroup
from liteinfer.engine.compiled import CompiledDecoder
from liteinfer.engine.detokenizer import IncrementalDetokenizer
from liteinfer.engine.model_runner import ModelRunner, StepResult
from liteinfer.engine.packaged import PackagedDecoder
from liteinfer.engine.scheduler import ScheduledBatch, Scheduler, StaticScheduler
from liteinfer.engine.sequence import Request, Sequence
from liteinfer.engine.speculative import num_accepted, propose_ngram
from liteinfer.engine.workers import ShardSpec, WorkerPool, pack_weights, weights_left_for_onednn
from liteinfer.layers.rotary import positions_served
from liteinfer.models.source import (
    ModelSource,
    generation_eos_token_ids,
    load_config,
    load_tokenizer,
    resolve_model,
    sampling_defaults,
    tokenizer_source,
)
from liteinfer.outputs import PositionLogprobs, RequestMetrics, RequestOutput
from liteinfer.sampling import NO_TOKEN, GrammarMatchers, RequestOutputKind, Sampler, SamplerOutput, SamplingParams

logger = logging.getLogger(__name__)

# A prompt given as text or, as vLLM accepts it, as {"prompt_token_ids": [...]}.
PromptType = str | dict[str, Any]


def encode_text(tokenizer: Any, text: str, **options: Any) -> list[int]:
    """`tokenizer.encode(text)`, with a ValueError for text that is not valid Unicode (a lone surrogate, which a JSON
    string's escapes can carry), where the tokenizer itself raises a TypeError that says nothing of why."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text is not valid Unicode: {exc.reason} at character {exc.start}") from None
    return tokenizer.encode(text, **options)


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each word's token ids in the two forms it takes in text: at its start, and after a space (as a word follows
    another). vLLM keeps the second form only where it has as many tokens as the first; a word whose spaced form
    merges into fewer tokens would then still be generated after a space, so both are kept here whenever they differ."""
    forms: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = encode_text(tokenizer, text, add_special_tokens=False)
            if ids not in forms:
                forms.append(ids)
    return forms


def truncated_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The prompt's last `keep` tokens (vLLM's truncate_prompt_tokens; -1: as many as leave room in the context for one
    generated token); the whole prompt for None."""
    if keep is None:
        return token_ids
    return token_ids[-(max_model_len - 1 if keep == -1 else keep):]


def whole_vocabulary_counted(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """`params` with logprobs and prompt_logprobs of -1 (vLLM's "the whole vocabulary") as the vocabulary's size."""
    whole = {name: vocab_size for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1}
    return replace(params, **whole) if whole else params


@dataclass(frozen=True)
class EngineStats:
    """The engine's load as of its last step."""

    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    kv_cache_usage: float = 0.0  # share of KV blocks in use, 0..1
    prefix_cache_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache so far
    prefix_cache_hit_tokens: int = 0  # of those, the ones found there
    spec_draft_tokens: int = 0  # speculative decoding's draft tokens computed so far
    spec_accepted_tokens: int = 0  # of those, the ones kept

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / queried if queried else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Share of the draft tokens computed that were kept."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if config.data_parallel_size > 1:
            raise ValueError("an LLMEngine is one replica: data_parallel_size > 1 is for LLM and AsyncLLM, which "
                             "start the replicas (engine/data_parallel.py)")
        self.config = config
        torch.manual_seed(config.seed)
        source = resolve_model(config.model, config.revision)
        self.hf_config = load_config(source)
        self.tokenizer = load_tokenizer(tokenizer_source(source, config.tokenizer, config.tokenizer_revision))
        self.sampling_defaults = sampling_defaults(source, config.generation_config)
        self.device = config.torch_device()
        if config.quantization is not None and self.device.type != "cpu":  # device="auto" found a GPU
            raise ValueError(f"quantization={config.quantization!r} runs on PyTorch's CPU kernels; use device='cpu'")
        self.dtype = config.torch_dtype(getattr(self.hf_config, "dtype", None))
        self.max_model_len = self._resolve_max_model_len()
        max_num_batched_tokens = config.max_num_batched_tokens or (
            2048 if config.chunked_prefill else max(8192, self.max_model_len)
        )
        if not config.chunked_prefill and max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) without chunked prefill, so that the longest prompt fits in one step"
            )

        # Rank 0 of tensor parallelism is this process; ranks 1..N-1 are worker processes (engine/workers.py).
        spec = ShardSpec(source, self.hf_config, self.dtype, self.device.type, config.block_size,
                         torch.get_num_threads(), self.max_model_len, config.quantization,
                         config.kv_cache_dtype == "int8")
        self.tp, self.workers = TensorParallelGroup(), None
        if config.tensor_parallel_size > 1:
            self._check_tensor_parallel()
            self.device = spec.device(0)
            self.workers, self.tp = WorkerPool.start(spec, config.tensor_parallel_size)
        try:
            model = spec.build_model(self.tp, self.device, onednn=config.enforce_eager)
            self.kv_cache = self._allocate_kv_cache(spec)
            if self.workers is not None:
                self.workers.allocate_kv_cache(self.kv_cache.num_blocks)
        except BaseException:
            self.shutdown()
            raise
        self.kv_cache.bind(model)
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching)
        if config.scheduler == "static":
            self.scheduler = StaticScheduler(self.block_manager, config.max_num_seqs, max_num_batched_tokens)
        else:
            self.scheduler = Scheduler(
                self.block_manager, config.max_num_seqs, max_num_batched_tokens,
                config.enable_chunked_prefill, config.long_prefill_token_threshold,
            )
        # The tokenizer's EOS ends a sequence with stop reason None; the others that the configs name (Llama 3's
        # <|eot_id|>, Gemma's <end_of_turn>) end it as stop token ids do, with their id, as vLLM reports them.
        self.eos_token_id: int | None = self.tokenizer.eos_token_id
        self.eos_token_ids = self._eos_token_ids(source)
        self.grammars = GrammarMatchers(self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids)
        compiled = None
        if not config.enforce_eager:
            # A CPU runs packages (engine/packaged.py) unless some W waits for oneDNN's prepacking, which only
            # torch.compile's freezing does; CUDA replays torch.compile's graphs as CUDA graphs.
            if self.device.type == "cpu" and not weights_left_for_onednn(model):
                compiled = PackagedDecoder(model, self.kv_cache, self.hf_config)
            else:
                # A decode step's rows: each sequence's token and its drafts.
                max_rows = config.max_num_seqs * (1 + config.num_speculative_tokens)
                compiled = CompiledDecoder(model, self.kv_cache, max_rows, self.max_blocks_per_seq)
            compiled.warm_up(self.device)
            # torch.compile's graphs hold inductor's own prepacked copies of the weights left for oneDNN; eager
            # (prefill) steps get theirs now. (The packages' form has none left.)
            pack_weights(model)
        self.runner = ModelRunner(model, Sampler(self.eos_token_ids), config.block_size, self.device, self.workers,
                                  compiled)
        self.requests: dict[str, Request] = {}
        self.num_draft_tokens = 0  # speculative decoding's drafts computed so far, and how many of them were kept
        self.num_accepted_tokens = 0

    def _resolve_max_model_len(self) -> int:
        limit = positions_served(self.hf_config)
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(f"max_model_len ({self.config.max_model_len}) exceeds the model's limit ({limit})")
        return self.config.max_model_len

    def _check_tensor_parallel(self) -> None:
        tp, hf = self.config.tensor_parallel_size, self.hf_config
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        if hf.num_attention_heads % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the number of attention heads "
                             f"({hf.num_attention_heads})")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the number of KV heads ({num_kv_heads}) "
                             "or be a multiple of it (KV heads are then replicated)")
        if hf.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide intermediate_size ({hf.intermediate_size})")
        if self.device.type == "cuda" and torch.cuda.device_count() < tp:
            raise ValueError(f"tensor_parallel_size ({tp}) needs as many CUDA devices; "
                             f"{torch.cuda.device_count()} are visible")

    @property
    def max_blocks_per_seq(self) -> int:
        """The blocks that a sequence of max_model_len tokens holds."""
        return -(-self.max_model_len // self.config.block_size)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at interpreter exit)."""
        if self.workers is not None:
            self.workers.shutdown()

    def _allocate_kv_cache(self, spec: ShardSpec) -> KVCache:
        """This rank's pool (its share of the KV heads); every rank gets the same number of blocks."""
        cfg = self.config
        num_layers, num_kv_heads, head_dim = spec.kv_cache_dims(self.tp)
        block_bytes = KVCache.bytes_per_block(num_layers, cfg.block_size, num_kv_heads, head_dim, self.dtype,
                                              spec.kv_cache_int8)
        blocks_per_seq = self.max_blocks_per_seq
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        else:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                budget = int(total * cfg.gpu_memory_utilization) - (total - free)
            else:
                budget = cfg.kv_cache_memory_bytes
            # Never more than every sequence at full length could use.
            num_blocks = min(budget // block_bytes, cfg.max_num_seqs * blocks_per_seq)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {cfg.block_size} tokens, fewer than one sequence of "
                f"max_model_len={self.max_model_len} needs ({blocks_per_seq}); lower max_model_len or give the "
                "cache more memory (kv_cache_memory_bytes / gpu_memory_utilization / num_kv_blocks)"
            )
        return spec.kv_cache(self.tp, num_blocks, self.device)

    def _eos_token_ids(self, source: ModelSource) -> set[int]:
        """The tokenizer's, the config's and the generation config's: any of them ends a sequence."""
        ids = {self.tokenizer.eos_token_id, *generation_eos_token_ids(source)}
        configured = getattr(self.hf_config, "eos_token_id", None)
        ids.update(configured if isinstance(configured, list) else [configured])
        return {i for i in ids if i is not None}

    # ----------------------------------------------------------------------------------------------------------
    # Requests

    def validate_request(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt, checked with its params; raises ValueError before anything is queued."""
        vocab = self.hf_config.vocab_size
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            if any(not 0 <= t < vocab for t in getattr(params, name) or ()):
                raise ValueError(f"{name} must name token ids in [0, {vocab}), got {getattr(params, name)}")
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)
        stop_ids = self.eos_token_ids.union(params.stop_token_ids)
        if params.min_tokens and params.allowed_token_ids and stop_ids.issuperset(params.allowed_token_ids):
            raise ValueError(f"allowed_token_ids {params.allowed_token_ids} are all end-of-sequence or stop tokens, "
                             f"which min_tokens={params.min_tokens} forbids: no token would be left to sample")
        max_logprobs = vocab if self.config.max_logprobs == -1 else self.config.max_logprobs
        params = whole_vocabulary_counted(params, vocab)
        for name in ("logprobs", "prompt_logprobs"):
            if (asked := getattr(params, name)) is not None and asked > max_logprobs:
                raise ValueError(f"{name} asks for {asked} top tokens, more than this engine's max_logprobs="
                                 f"{self.config.max_logprobs} (an engine option; -1 for the whole vocabulary)")
        if isinstance(prompt, str):
            text, token_ids = prompt, encode_text(self.tokenizer, prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            vocab = self.hf_config.vocab_size
            # A bool is an int, but True as a token id is a caller bug (SamplingParams rejects it too).
            if not isinstance(token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in token_ids
            ):
                raise ValueError(f"prompt_token_ids must be a list of integers in [0, {vocab})")
            token_ids = list(token_ids)
        else:
            raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty")
        token_ids = truncated_prompt(token_ids, params.truncate_prompt_tokens, self.max_model_len)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}: "
                "it must be shorter to leave room for at least one generated token"
            )
        return text, token_ids

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = whole_vocabulary_counted(params or self.default_sampling_params(), self.hf_config.vocab_size)
        text, token_ids = self.validate_request(prompt, params)
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words)
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        seqs = [
            Sequence(
                request_id=request_id,
                index=index,
                token_ids=list(token_ids),
                num_prompt_tokens=len(token_ids),
                params=params,
                max_tokens=max_tokens,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, token_ids, params.skip_special_tokens, params.stop,
                    params.include_stop_str_in_output, params.min_tokens,
                ),
                seed=None if params.seed is None else hash((params.seed, index)),  # samples differ, runs repeat
                bad_words_token_ids=bad_words,
                grammar=None if params.structured_outputs is None else self.grammars.matcher(params.structured_outputs),
                prompt_logprobs=[None] if params.prompt_logprobs is not None and index == 0 else None,
            )
            for index in range(params.n)
        ]
        metrics = RequestMetrics(arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        request = Request(request_id, text, token_ids, params, seqs, metrics, unforked=seqs[1:])
        self.requests[request_id] = request
        self.scheduler.add(seqs[0])

    def default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams samples with (`EngineConfig.generation_config`)."""
        return SamplingParams(**self.sampling_defaults)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (None if it is unknown)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        request.unforked.clear()
        request.metrics.finished_time = time.monotonic()
        return request.to_output(delta=request.params.output_kind is RequestOutputKind.DELTA)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(len(scheduler.running), len(scheduler.waiting), self.block_manager.usage,
                           scheduler.prefix_queried_tokens, scheduler.prefix_hit_tokens, self.num_draft_tokens,
                           self.num_accepted_tokens)

    # ----------------------------------------------------------------------------------------------------------
    # The loop

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return the outputs of every request that got a new token (of those that
        asked for `RequestOutputKind.FINAL_ONLY`, only the finished ones; of `DELTA` ones, what is new)."""
        batch = self.scheduler.schedule()
        for seq in batch.preempted:
            self.requests[seq.request_id].metrics.num_preemptions += 1
        if not batch.seqs:
            return []
        now = time.monotonic()
        for seq in batch.seqs:
            metrics = self.requests[seq.request_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
        result = self.runner.execute(batch)
        kept_rows = self._kept_rows(batch, result)
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            token_ids = seq.token_ids
            if seq.spec_token_ids:
                # Of its drafts, the K/V of those kept hold the tokens they are; the others' slots are written over
                # later.
                kept_drafts = seq.spec_token_ids[: len(kept_rows[i]) - 1]
                num_new -= len(seq.spec_token_ids) - len(kept_drafts)
                self.num_draft_tokens += len(seq.spec_token_ids)
                self.num_accepted_tokens += len(kept_drafts)
                token_ids = seq.token_ids + kept_drafts
                seq.spec_token_ids = []
            start, seq.num_computed_tokens = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            self.block_manager.cache_blocks(seq.block_table, token_ids, seq.block_hashes, start, start + num_new)
        for i, positions in result.prompt_logprobs.items():
            batch.seqs[i].prompt_logprobs += map(self._with_text, positions)

        updated: dict[str, Request] = {}
        for i, rows in kept_rows.items():
            seq = batch.seqs[i]
            for row in rows:
                request = self.requests.get(seq.request_id)
                if request is None or seq.is_finished:  # failed earlier in this loop and was aborted, or has ended
                    break
                try:
                    self._append_token(request, seq, result.sampled, row)
                except Exception as exc:  # one request's failure must not take the others down
                    logger.exception("request %s failed", request.request_id)
                    request.error = f"{type(exc).__name__}: {exc}"
                    self.abort_request(request.request_id)
                updated[request.request_id] = request
        if self.config.speculative_config is not None:
            self._propose_drafts(batch.seqs)
        outputs = []
        for request in updated.values():
            if request.is_finished:
                request.metrics.finished_time = request.metrics.finished_time or time.monotonic()
                self.requests.pop(request.request_id, None)
            elif request.params.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            outputs.append(request.to_output(delta=request.params.output_kind is RequestOutputKind.DELTA))
        return outputs

    @staticmethod
    def _kept_rows(batch: ScheduledBatch, result: StepResult) -> dict[int, list[int]]:
        """The sampled rows whose tokens each sequence keeps, by batch position, in the order of the rows: its one
        row, or with drafts the rows up to the first whose token differs from its draft (engine/speculative.py)."""
        rows: dict[int, list[int]] = {}
        for row, i in enumerate(result.sampled_seqs):
            rows.setdefault(i, []).append(row)
        for i, seq_rows in rows.items():
            if drafts := batch.seqs[i].spec_token_ids:
                sampled = [result.sampled.token_ids[row] for row in seq_rows]
                del seq_rows[num_accepted(drafts, sampled) + 1 :]
        return rows

    def _propose_drafts(self, seqs: list[Sequence]) -> None:
        """Draft tokens for the sequences that go on decoding: never past their last position (max_tokens, which
        the context holds); none for a structured output, whose format's matcher advances only on kept tokens; none
        at all while more sequences than `disable_by_batch_size` are running or waiting."""
        spec = self.config.speculative_config
        busy = len(self.scheduler.running) + len(self.scheduler.waiting)
        if spec.disable_by_batch_size is not None and busy > spec.disable_by_batch_size:
            return
        for seq in seqs:
            # (Its one uncomputed token a generated one: after a prompt's chunk that left its last token, no drafts.)
            decoding = seq.num_prompt_tokens <= seq.num_computed_tokens == seq.num_tokens - 1
            if seq.is_finished or seq.grammar is not None or not decoding:
                continue
            room = min(spec.num_speculative_tokens, seq.max_tokens - seq.num_output_tokens - 1)
            seq.spec_token_ids = propose_ngram(seq.token_ids, room, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _append_token(self, request: Request, seq: Sequence, out: SamplerOutput, row: int) -> None:
        token = out.token_ids[row]
        if token == NO_TOKEN:
            raise ValueError("no token is left to sample: the request's allowed_token_ids, structured output format, "
                             "bad_words and min_tokens together exclude every one")
        # A matcher in error allows EOS and takes it: is_error, or the output would end "stop", cut short.
        if seq.grammar is not None and (not seq.grammar.consume_token(token) or seq.grammar.is_error()):
            raise ValueError(f"token {token} breaks the structured output's format: {seq.grammar.get_error()}")
        seq.token_ids.append(token)
        request.metrics.first_token_time = request.metrics.first_token_time or time.monotonic()
        if seq.params.logprobs is not None:
            seq.cumulative_logprob += out.logprobs[row]
            seq.logprobs.append(self._with_text(out.top_logprobs[row]))
        if seq.index == 0 and request.unforked:
            self._fork(request, seq)

        params = seq.params
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        if is_eos or token in params.stop_token_ids:
            # As in vLLM, a stop token (an EOS id, or one of stop_token_ids) stays in token_ids but its text only with
            # include_stop_str_in_output.
            if params.include_stop_str_in_output:
                seq.detokenizer.step([token])
            self._finish(seq, "stop", None if is_eos and token == self.eos_token_id else token)
            return
        seq.detokenizer.step([token])
        if seq.detokenizer.stop_reason is not None:
            self._finish(seq, "stop", seq.detokenizer.stop_reason)
        elif seq.num_output_tokens >= seq.max_tokens:
            self._finish(seq, "length", None)

    def _with_text(self, position: PositionLogprobs) -> PositionLogprobs:
        """A position's logprobs, each with its token's text."""
        return {t: replace(lp, decoded_token=self.tokenizer.decode([t])) for t, lp in position.items()}

    def _fork(self, request: Request, parent: Sequence) -> None:
        """Start samples 1..n-1 from the blocks that hold the parent's prompt (all but a partial last block,
        and never the block of the last prompt token, whose logits each sample computes for itself)."""
        shared_blocks = (parent.num_prompt_tokens - 1) // self.config.block_size
        for child in reversed(request.unforked):
            child.block_table = self.block_manager.share(parent.block_table[:shared_blocks])
            child.num_computed_tokens = shared_blocks * self.config.block_size
            self.scheduler.add(child, front=True)
        request.unforked.clear()

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None) -> None:
        if not isinstance(stop_reason, str):  # text held back as a possible stop-string start is released
            seq.detokenizer.flush()
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)
