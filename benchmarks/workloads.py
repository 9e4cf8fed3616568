"""Workloads: which prompts each engine gets, how many output tokens it must produce, and when requests are sent.

Prompts are token ids drawn uniformly from the tokenizer's ordinary (non-special) tokens with a seeded generator,
so every engine sees exactly the same input (no tokenizer or chat-template differences), no two prompts share a
prefix by accident (which would flatter an engine with prefix caching), and a workload is reproduced from its
parameters alone. The hash of the request list identifies a workload across runs and machines.

- throughput: every request is sent at once; prompt lengths uniform in [prompt_min, prompt_max].
- latency:    the first `latency_prompts` requests of `throughput`, sent one at a time (one in flight).
- prefix:     every request at once; each prompt is one shared `prefix_len`-token system prompt followed by its
              own throughput-style question.
- mixed:      every request at once; prompt lengths uniform in [prompt_min, 4 * prompt_max] and output lengths
              uniform in [ceil(output_len / 8), 2 * output_len].

Every request is greedy unless the parameters give it a `Sampling` (a temperature, with top-k and top-p): then each
engine draws its tokens from the same truncated distribution, with its own random numbers, so the token ids differ
from engine to engine and from run to run (their count is still forced).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace

import numpy as np

WORKLOAD_NAMES = ("throughput", "latency", "prefix", "mixed")


@dataclass(frozen=True)
class Sampling:
    """How an engine picks each output token: greedy (temperature 0, the default), or drawn at `temperature` from
    the tokens that top-k (0: no limit) and then top-p (1.0: no limit) keep of the tempered distribution, the order
    of `transformers` and vLLM."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no limit), got {self.top_k}")
        if self.greedy and (self.top_p < 1 or self.top_k):
            raise ValueError("top_p and top_k truncate a sampled distribution: give a temperature above 0 with them")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        limits = ([f"top-k {self.top_k}"] if self.top_k else []) + ([f"top-p {self.top_p}"] if self.top_p < 1 else [])
        return f"sampled at temperature {self.temperature}" + "".join(f", {limit}" for limit in limits)


GREEDY = Sampling()


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # exactly this many tokens must come back: EOS is ignored and min_tokens = max_tokens
    sampling: Sampling = GREEDY


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[BenchRequest]
    one_at_a_time: bool  # send each request only when the previous one has finished

    @property
    def hash(self) -> str:
        payload = asdict(self)
        for request in payload["requests"]:
            # A greedy request hashes as it did before sampling was a choice: hashes in recorded results still hold.
            if request["sampling"] == asdict(GREEDY):
                del request["sampling"]
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def describe(self) -> str:
        prompt_lens = [len(r.prompt_token_ids) for r in self.requests]
        output_lens = [r.output_len for r in self.requests]
        mode = "one at a time" if self.one_at_a_time else "all at once"
        samplings = {r.sampling for r in self.requests} - {GREEDY}
        return (f"{self.name}: {len(self.requests)} requests {mode}, prompts {min(prompt_lens)}-{max(prompt_lens)} "
                f"tokens, outputs {min(output_lens)}-{max(output_lens)} tokens"
                + "".join(f", {s.describe()}" for s in sorted(samplings, key=Sampling.describe)))


@dataclass(frozen=True)
class WorkloadParams:
    num_prompts: int = 32
    prompt_min: int = 20
    prompt_max: int = 60
    output_len: int = 128
    prefix_len: int = 256
    latency_prompts: int = 4
    seed: int = 0
    sampling: Sampling = GREEDY  # every request's

    def __post_init__(self) -> None:
        """Refused here, before any engine runs (an output length of 0 had failed the summary after a whole run)."""
        for field, least in (("num_prompts", 1), ("output_len", 1), ("prefix_len", 0), ("latency_prompts", 1)):
            if getattr(self, field) < least:
                raise ValueError(f"{field} must be at least {least}, got {getattr(self, field)}")


def make_workload(name: str, params: WorkloadParams, token_ids: list[int]) -> Workload:
    """Build workload `name` from prompt tokens drawn out of `token_ids` (the vocabulary minus special tokens)."""
    if name not in WORKLOAD_NAMES:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
    p = params
    if not 1 <= p.prompt_min <= p.prompt_max:
        raise ValueError(f"need 1 <= prompt_min <= prompt_max, got {p.prompt_min}, {p.prompt_max}")
    if name == "latency" and p.latency_prompts > p.num_prompts:
        raise ValueError(f"latency_prompts ({p.latency_prompts}) are the first of num_prompts ({p.num_prompts}): "
                         "at most as many")
    # One generator per workload, seeded by its name too, so that adding a workload never changes another;
    # latency shares throughput's so that its prompts are the first ones of throughput's.
    stream = WORKLOAD_NAMES.index("throughput" if name == "latency" else name)
    rng = np.random.default_rng([p.seed, stream])
    vocab = np.asarray(token_ids)

    def prompt(length: int) -> list[int]:
        return rng.choice(vocab, size=length).tolist()

    if name in ("throughput", "latency"):
        lengths = rng.integers(p.prompt_min, p.prompt_max + 1, size=p.num_prompts)
        requests = [BenchRequest(prompt(int(n)), p.output_len, p.sampling) for n in lengths]
        if name == "latency":
            requests = requests[:p.latency_prompts]
    elif name == "prefix":
        shared = prompt(p.prefix_len)
        lengths = rng.integers(p.prompt_min, p.prompt_max + 1, size=p.num_prompts)
        requests = [BenchRequest(shared + prompt(int(n)), p.output_len, p.sampling) for n in lengths]
    else:
        lengths = rng.integers(p.prompt_min, 4 * p.prompt_max + 1, size=p.num_prompts)
        outputs = rng.integers(-(-p.output_len // 8), 2 * p.output_len + 1, size=p.num_prompts)
        requests = [BenchRequest(prompt(int(n)), int(m), p.sampling) for n, m in zip(lengths, outputs)]
    return Workload(name, requests, one_at_a_time=name == "latency")


def warmup_workload(name: str, params: WorkloadParams, token_ids: list[int], max_output_len: int) -> Workload:
    """The same kind of work (request count, length ranges, arrival pattern) from another seed, with at most
    `max_output_len` output tokens: it runs the same code paths and batch sizes, and its prompts share nothing
    with the measured ones, so a prefix cache it fills cannot flatter the measurement."""
    other = make_workload(name, replace(params, seed=params.seed + 1), token_ids)
    requests = [replace(r, output_len=min(r.output_len, max_output_len)) for r in other.requests]
    return Workload(f"{name}-warmup", requests, other.one_at_a_time)
