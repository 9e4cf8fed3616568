"""The interface every engine implements, and how an engine variant is named on the command line."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from benchmarks.metrics import RequestTrace
from benchmarks.workloads import BenchRequest

_PRECISION_ALIASES = {
    "fp32": "fp32", "f32": "fp32", "float32": "fp32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "f16": "fp16", "float16": "fp16",
}
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class EngineSpec:
    """`ENGINE:PRECISION[:OPTION...]`, e.g. `liteinfer:bf16`, `transformers:bf16:32` (batch width 32),
    `liteinfer:fp32:scheduler=static:max_num_seqs=8` (any `key=value` goes to the engine's own configuration; a dotted
    key, a field of an option that takes a dict: `speculative_config.num_speculative_tokens=4`).
    Its name, the spec with `-` for `:`, labels its rows and is what `--compare` refers to."""

    engine: str
    precision: str
    options: dict[str, Any] = field(default_factory=dict)
    text: str = ""

    @property
    def name(self) -> str:
        return self.text.replace(":", "-")

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        engine, *rest = text.split(":")
        if engine not in RUNNERS:
            raise ValueError(f"unknown engine {engine!r} in {text!r}; engines: {', '.join(RUNNERS)}")
        if not rest or not rest[0]:
            raise ValueError(f"{text!r} names no precision: write {engine}:bf16, {engine}:fp32, ...")
        precision, *options_text = rest
        options: dict[str, Any] = {}
        for item in options_text:
            if item.isdigit():
                options["batch"] = int(item)
            elif "=" in item:
                key, value = item.split("=", 1)
                # A dotted key sets a field of an option that takes a dict (JSON's colons would split the spec):
                # speculative_config.num_speculative_tokens=4.
                *outer, key = key.split(".")
                target = options
                for name in outer:
                    target = target.setdefault(name, {})
                target[key] = _parse_value(value)
            else:
                raise ValueError(f"{text!r}: {item!r} is neither a batch width nor key=value")
        precision = precision.lower()
        return cls(engine, _PRECISION_ALIASES.get(precision, precision), options, text)


def _parse_value(text: str) -> Any:
    """`8` -> 8, `0.5` -> 0.5, `true` -> True, `null` -> None, anything else stays a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class EngineRunner(ABC):
    """One engine variant, driven by the harness in a process of its own:
    `start()` (load the model), `run(requests)` any number of times, `stop()`.

    `run` sends every request at once, as one client would, and returns a `RequestTrace` per request in order,
    each with exactly the forced number of output tokens (EOS ignored; greedy, or drawn as the request's `sampling`
    says) and a timestamp per token.
    """

    # How this engine's token timestamps are taken; recorded with every result, so readers know what TTFT and
    # inter-token latency mean for it.
    timing = ""

    def __init__(self, spec: EngineSpec, model: str, threads: int, max_num_seqs: int, max_seq_len: int):
        self.spec = spec
        self.model = model
        self.threads = threads
        # The most requests one `run` call will get and the longest request (prompt + output tokens), for engines
        # that size their buffers up front.
        self.max_num_seqs = max_num_seqs
        self.max_seq_len = max_seq_len
        self.device = "cpu"  # where the engine keeps its weights: "cpu" or "cuda"
        self.details: dict[str, Any] = {}  # what the engine reports about itself (versions, files, batch width)

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def run(self, requests: list[BenchRequest]) -> list[RequestTrace]: ...

    def stop(self) -> None:  # noqa: B027  (optional: the process ends right after, so most engines free nothing)
        """Free what `start` took."""


_request_ids = itertools.count()


def run_step_loop(engine: Any, sampling_params: type, delta: Any, requests: list[BenchRequest]) -> list[RequestTrace]:
    """Add every request to a vLLM-style engine (liteinfer's `LLMEngine` or vLLM's), then `step()` it until it is
    idle, stamping each new token when the step that sampled it returns: what a streaming caller would see. The
    requests ask for `delta` outputs (the engine's `RequestOutputKind.DELTA`), as a streaming server does: each
    output holds only the tokens new since the last one."""
    submitted = time.perf_counter()
    ids = [f"bench-{next(_request_ids)}" for _ in requests]
    for request_id, request in zip(ids, requests):
        sampling = request.sampling
        params = sampling_params(temperature=sampling.temperature, top_p=sampling.top_p,
                                 top_k=sampling.top_k or -1,  # -1: no limit, in every vLLM version
                                 max_tokens=request.output_len, min_tokens=request.output_len, ignore_eos=True,
                                 output_kind=delta)
        engine.add_request(request_id, {"prompt_token_ids": request.prompt_token_ids}, params)
    traces = {request_id: RequestTrace(submitted, [], []) for request_id in ids}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            trace, new = traces[output.request_id], output.outputs[0].token_ids
            trace.token_ids.extend(new)
            trace.token_times.extend([now] * len(new))
    return [traces[request_id] for request_id in ids]


# Engine name -> (module, class). The harness imports only the runner it needs, in the engine's own process, so
# that a llama.cpp process never loads torch and the memory it reports is its own.
RUNNERS = {
    "liteinfer": ("benchmarks.runners.liteinfer", "LiteInferRunner"),
    "transformers": ("benchmarks.runners.transformers", "TransformersRunner"),
    "llamacpp": ("benchmarks.runners.llamacpp", "LlamaCppRunner"),
    "vllm": ("benchmarks.runners.vllm", "VLLMRunner"),
    "roofline": ("benchmarks.runners.roofline", "LinearsRooflineRunner"),  # the model's linears alone
}
# The engines that are not dependencies of liteinfer: the module each needs, and how to get it.
OPTIONAL_ENGINES = {
    "llamacpp": ("llama_cpp", "pip install -e '.[bench]' (builds llama.cpp from source, ~6 min on 2 cores)"),
    "vllm": ("vllm", "pip install vllm, on a machine with a CUDA GPU"),
}


def unavailable(engine: str) -> str | None:
    """Why `engine` cannot run here (its package is missing), or None if it can."""
    if engine in OPTIONAL_ENGINES:
        module, hint = OPTIONAL_ENGINES[engine]
        if importlib.util.find_spec(module) is None:
            return f"{engine} skipped: {module} is not installed ({hint})"
    return None


def runner_class(engine: str) -> type[EngineRunner]:
    module, name = RUNNERS[engine]
    return getattr(importlib.import_module(module), name)
