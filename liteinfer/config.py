"""Engine configuration: every knob `LLM(model, **fields)` accepts, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SpeculativeConfig:
    """Speculative decoding by prompt lookup (vLLM's `method="ngram"`): each decode step also computes up to
    `num_speculative_tokens` draft tokens, copied from what followed the latest earlier occurrence of the sequence's
    last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`), and keeps those the model would have
    sampled itself (engine/speculative.py). As in vLLM, a bound left out takes the other's value, and both 5 when
    neither is given. `disable_by_batch_size`: no drafts while more sequences than this are running or waiting
    (a wide batch is bound by arithmetic, where every draft's row costs as much as a real one's)."""

    num_speculative_tokens: int
    method: Literal["ngram"] = "ngram"
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config's method must be 'ngram' (prompt lookup; no draft model yet), got "
                             f"{self.method!r}")
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max = self.prompt_lookup_min = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config's {name} must be an integer >= 1, got {value!r}")
        if self.disable_by_batch_size is not None and (not isinstance(self.disable_by_batch_size, int)
                                                       or isinstance(self.disable_by_batch_size, bool)
                                                       or self.disable_by_batch_size < 1):
            raise ValueError(f"speculative_config's disable_by_batch_size must be None or an integer >= 1, got "
                             f"{self.disable_by_batch_size!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config's prompt_lookup_min ({self.prompt_lookup_min}) must not exceed its "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any]) -> SpeculativeConfig:
        """A SpeculativeConfig from itself or, as vLLM's `speculative_config` takes it, a dict of its fields."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict of its fields or a SpeculativeConfig, got {value!r}")
        if unknown := sorted(set(value) - {f.name for f in fields(cls)}):
            raise ValueError(f"speculative_config has no field {', '.join(unknown)}; its fields: "
                             f"{', '.join(f.name for f in fields(cls))}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens, the most draft tokens a step computes "
                             "per sequence")
        return cls(**value)


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    # A Hub model's version (branch, tag or commit); the tokenizer from elsewhere (a directory, .gguf file or Hub id;
    # None: the model's own) and its version (vLLM's options).
    revision: str | None = None
    tokenizer: str | None = None
    tokenizer_revision: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None  # None = the positions the model serves (layers/rotary.py: positions_served)
    max_num_seqs: int = 256
    # Tokens computed per step. None = 2048 with chunked prefill (bounds attention's memory on long prompts),
    # else max(8192, max_model_len) so that any prompt fits in one step.
    max_num_batched_tokens: int | None = None
    # Tokens per KV block. None = 16 on CUDA, 32 on a CPU (64 with int8 pools): there decode attention reads a block's
    # rows for one KV head as one run (heads of 64: 4 KiB at 32 in bf16, at 64 in int8), and on an AMD Zen 4 took
    # 0.82-0.88x its time at 32 sequences, the mixed workload of 256 requests 1-9% faster than at 16 over four paired
    # rounds; with int8 pools 64 against 32 1-7% (docs/benchmarks.md).
    block_size: int | None = None
    num_kv_blocks: int | None = None  # None = sized from the memory budget below
    gpu_memory_utilization: float = 0.9  # share of GPU memory the weights + KV cache may take
    kv_cache_memory_bytes: int = 2 << 30  # CPU: bytes given to the KV cache
    # auto: K/V in the model's dtype. int8 (CPU): each K/V row in bytes at its own scale, 68 bytes for bf16's 128 at
    # heads of 64, so 1.88x the tokens fit and decode attention reads about half as much (cache/kv_cache.py).
    kv_cache_dtype: Literal["auto", "int8"] = "auto"
    scheduler: Literal["continuous", "static"] = "continuous"
    enable_prefix_caching: bool = True
    quantization: Literal["int8", "int4"] | None = None  # weight-only, CPU (layers/quantization.py)
    enable_chunked_prefill: bool = True  # continuous scheduler only
    # With chunked prefill, the most tokens a prefill in progress takes per step while others wait.
    # None = a quarter of max_num_batched_tokens.
    long_prefill_token_threshold: int | None = None
    # False: decode steps run as one compiled graph, made when the engine starts: on a CPU, AOTInductor packages
    # kept on disk (engine/packaged.py; SmolLM2 on 2 cores: ~80 s the first time, 5 s once made); on CUDA,
    # torch.compile's graphs replayed as CUDA graphs (engine/compiled.py). True keeps every step on the eager path.
    enforce_eager: bool = True
    seed: int = 0
    # The most top tokens a request's `logprobs` may ask for at each position (vLLM's option and default); -1: the
    # whole vocabulary. A step's logprobs are gathered for the largest number any of its rows asks for.
    max_logprobs: int = 20
    # The sampling a request without SamplingParams (or a server request leaving fields out) gets, as vLLM's
    # --generation-config: "auto", what the checkpoint's generation_config.json recommends (temperature, top_p,
    # top_k, min_p, repetition_penalty, max_new_tokens); "vllm", SamplingParams' own defaults; or a directory
    # holding the generation_config.json to take them from.
    generation_config: str = "auto"
    # Ranks the model is sharded over (Megatron-style, one process per rank on this host; see engine/workers.py).
    tensor_parallel_size: int = 1
    # Engine replicas, each of tensor_parallel_size ranks, run as Ray actors; requests go to the least loaded.
    data_parallel_size: int = 1
    ray_address: str | None = None  # the Ray cluster the replicas join; None starts a local one
    # Speculative decoding: None (off), or a SpeculativeConfig or a dict of its fields (vLLM's form,
    # {"method": "ngram", "num_speculative_tokens": 3}), made a SpeculativeConfig here.
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        def require(ok: bool, field: str, why: str) -> None:
            if not ok:
                raise ValueError(f"{field} {why}, got {getattr(self, field)!r}")

        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "int | None") and value is not None:
                require(isinstance(value, int) and not isinstance(value, bool), f.name, "must be an integer")
        require(isinstance(self.model, str) and bool(self.model), "model", "must be a non-empty string")
        for name in ("revision", "tokenizer", "tokenizer_revision"):
            value = getattr(self, name)
            require(value is None or (isinstance(value, str) and bool(value)), name,
                    "must be None or a non-empty string")
        require(self.dtype in ("auto", *_DTYPES), "dtype", f"must be one of auto, {', '.join(_DTYPES)}")
        require(self.device in ("auto", "cpu", "cuda"), "device", "must be auto, cpu or cuda")
        require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1")
        require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        require(
            self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            "must be >= 1",
        )
        if self.block_size is None:
            self.block_size = 16 if self._device_type() == "cuda" else 64 if self.kv_cache_dtype == "int8" else 32
        require(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0, "block_size",
                "must be a power of two")
        require(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        require(isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1,
                "gpu_memory_utilization", "must be in (0, 1]")
        require(self.kv_cache_memory_bytes >= 1, "kv_cache_memory_bytes", "must be >= 1")
        require(self.scheduler in ("continuous", "static"), "scheduler", "must be continuous or static")
        require(self.kv_cache_dtype in ("auto", "int8"), "kv_cache_dtype", "must be auto or int8")
        require(self.kv_cache_dtype != "int8" or self.device != "cuda", "kv_cache_dtype",
                "int8 runs on CPU: it needs device='cpu'")
        require(self.kv_cache_dtype != "int8" or self.block_size >= 4, "kv_cache_dtype",
                "int8 interleaves four keys' values: it needs block_size >= 4")
        require(self.quantization in (None, "int8", "int4"), "quantization", "must be None, int8 or int4")
        require(self.quantization is None or self.device != "cuda", "quantization",
                "runs on PyTorch's CPU kernels: it needs device='cpu'")
        for flag in ("enable_prefix_caching", "enable_chunked_prefill"):
            require(isinstance(getattr(self, flag), bool), flag, "must be a bool")
        require(self.long_prefill_token_threshold is None or self.long_prefill_token_threshold >= 1,
                "long_prefill_token_threshold", "must be >= 1")
        require(isinstance(self.generation_config, str) and bool(self.generation_config), "generation_config",
                "must be 'auto', 'vllm' or a directory")
        require(self.max_logprobs >= -1, "max_logprobs", "must be >= 0, or -1 for the whole vocabulary")
        require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        require(self.data_parallel_size >= 1, "data_parallel_size", "must be >= 1")
        require(self.ray_address is None or isinstance(self.ray_address, str), "ray_address",
                "must be a Ray address string or None")
        require(isinstance(self.enforce_eager, bool), "enforce_eager", "must be a bool")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        require(self.enforce_eager or self.tensor_parallel_size == 1, "enforce_eager",
                "must be True with tensor_parallel_size > 1 (the compiled decode step is single-rank so far)")

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; valid options: {sorted(known)}")
        return cls(model=model or DEFAULT_MODEL, **kwargs)

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens a decode step may compute per sequence (0: no speculative decoding)."""
        return 0 if self.speculative_config is None else self.speculative_config.num_speculative_tokens

    @property
    def chunked_prefill(self) -> bool:
        return self.enable_chunked_prefill and self.scheduler == "continuous"

    def _device_type(self) -> str:
        """cpu or cuda: `device` with auto resolved, whether or not the device asked for is there."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def torch_device(self) -> torch.device:
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but no CUDA device is available")
        return torch.device(self._device_type())

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """auto = the checkpoint's own float dtype, float32 when it declares none (GGUF, old configs)."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        return checkpoint_dtype if checkpoint_dtype in _DTYPES.values() else torch.float32
