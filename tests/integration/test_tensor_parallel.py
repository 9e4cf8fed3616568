"""Tensor parallelism on CPU (gloo): sharded ranks give one rank's greedy tokens, load only their slices, fail
loudly when a worker dies, and leave no process behind."""

import os
import signal
import time

import pytest
import torch
from conftest import assert_same_prompt_scores
from parity import one_torch_thread  # noqa: F401 - an autouse fixture

from liteinfer import LLM, SamplingParams
from liteinfer.distributed import TensorParallelGroup
from liteinfer.engine.workers import WorkerError
from liteinfer.models import get_model_class
from liteinfer.models.loader import build_model, iter_checkpoint
from liteinfer.models.source import load_config, resolve_model

# Shared prefixes (prefix-cache hits) and prompts longer than the step's token budget (chunked prefill).
PREFIX = "You are a helpful assistant. Answer briefly and truthfully, in plain words, and never make anything up. "
PROMPTS = [PREFIX + q for q in ["What is the sky?", "Why is the sea salty?", "Name a fruit.", "Count to five."]] + [
    "Hello", "The capital of France is", "Once upon a time there was a", "def fibonacci(n):",
]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# A pool too small for every sequence at full length (20 blocks of 16 tokens): later sequences are preempted and
# recomputed.
OPTIONS = dict(dtype="float32", block_size=16, num_kv_blocks=20, max_model_len=96, max_num_batched_tokens=64)


def run(directory, **options) -> tuple[list[list[int]], int, int]:
    """(greedy tokens of PROMPTS, then of PROMPTS' first half again; preemptions; prefix-cached prompt tokens)."""
    with LLM(str(directory), **OPTIONS, **options) as llm:
        outputs = llm.generate(PROMPTS, GREEDY) + llm.generate(PROMPTS[:4], GREEDY)
    preemptions = sum(out.metrics.num_preemptions for out in outputs)
    return [out.outputs[0].token_ids for out in outputs], preemptions, sum(out.num_cached_tokens for out in outputs)


def test_tp2_greedy_tokens_equal_tp1_with_prefix_caching_and_preemption(tiny_llama):
    """Every tiny variant: GQA (KV heads split), MHA with a tied head, one KV head (replicated on both ranks)."""
    directory, _ = tiny_llama
    expected, preemptions, cached = run(directory)
    assert preemptions > 0 and cached > 0, "the test should exercise preemption and prefix caching"
    assert run(directory, tensor_parallel_size=2) == (expected, preemptions, cached)


def test_tp2_prompt_logprobs_equal_tp1(tiny_llama_dir):
    """Prompt positions scored for their logprobs go through the ranks' one head call a step, as sampled rows do,
    chunked and after preemptions too."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)

    def outputs(**options):
        with LLM(str(tiny_llama_dir), **OPTIONS, **options) as llm:
            return llm.generate(PROMPTS, params)

    expected, sharded = outputs(), outputs(tensor_parallel_size=2)
    assert [out.outputs[0].token_ids for out in sharded] == [out.outputs[0].token_ids for out in expected]
    assert_same_prompt_scores(sharded, [out.prompt_logprobs for out in expected])


def test_tp2_scores_a_long_prompt_in_the_same_head_calls_as_rank_0(tiny_llama_dir):
    """A step scoring more prompt positions than one head call takes (`SCORED_ROWS_AT_ONCE`): every rank makes
    the same calls, one for the sampling rows and one per group of scored rows."""
    prompt = {"prompt_token_ids": [(7 * i) % 3000 + 10 for i in range(400)]}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    options = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=512)

    def outputs(**more):
        with LLM(str(tiny_llama_dir), **options, **more) as llm:
            return llm.generate([prompt, "Hello"], params)

    expected, sharded = outputs(), outputs(tensor_parallel_size=2)
    assert [out.outputs[0].token_ids for out in sharded] == [out.outputs[0].token_ids for out in expected]
    assert_same_prompt_scores(sharded, [out.prompt_logprobs for out in expected])


class Recorded:
    """A checkpoint tensor that records how many elements each read takes."""

    def __init__(self, tensor, sizes: list[int]):
        self.tensor, self.sizes, self.shape, self.dtype = tensor, sizes, tensor.shape, tensor.dtype

    def narrow(self, *args) -> torch.Tensor:
        return self._record(self.tensor.narrow(*args))

    def __getitem__(self, index) -> torch.Tensor:
        return self._record(self.tensor[index])

    def _record(self, read: torch.Tensor) -> torch.Tensor:
        self.sizes.append(read.numel())
        return read


def test_each_rank_reads_only_its_slices_of_the_weights(tiny_llama_dir):
    """Loading rank r of 2 in this process (loading needs no collective): every matrix is read in pieces of at
    most half of it, and the ranks' pieces put together are the checkpoint's tensor."""
    source = resolve_model(str(tiny_llama_dir))
    config = load_config(source)
    model_cls = get_model_class(config.architectures)
    full = {name: tensor.shape.numel() for name, tensor in iter_checkpoint(source, config)}
    shards = []
    for rank in range(2):
        reads: dict[str, list[int]] = {}
        checkpoint = (
            (name, Recorded(t, reads.setdefault(name, []))) for name, t in iter_checkpoint(source, config, lazy=True)
        )
        shards.append(build_model(model_cls, config, torch.float32, torch.device("cpu"), checkpoint,
                                  TensorParallelGroup(rank, 2)).state_dict())
        for name, sizes in reads.items():
            if "norm" not in name:  # norms are replicated (a few hundred floats)
                assert sizes and max(sizes) <= full[name] // 2, f"rank {rank} read {sizes} of {name} ({full[name]})"

    whole = build_model(model_cls, config, torch.float32, torch.device("cpu"), iter_checkpoint(source, config))
    hidden, dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    for name, param in whole.state_dict().items():
        a, b = shards[0][name], shards[1][name]
        if "norm" in name:
            assert torch.equal(a, param) and torch.equal(b, param)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):  # row-parallel: input columns
            assert torch.equal(torch.cat([a, b], dim=1), param)
        elif "qkv_proj" in name:  # column-parallel: each rank's q, k, v rows, put back in q, k, v order
            sizes = [config.num_attention_heads * dim // 2] + [config.num_key_value_heads * dim // 2] * 2
            parts = zip(a.split(sizes), b.split(sizes))
            assert torch.equal(torch.cat([torch.cat(pair) for pair in parts]), param)
        elif "gate_up_proj" in name:
            half = config.intermediate_size // 2
            parts = zip(a.split(half), b.split(half))
            assert torch.equal(torch.cat([torch.cat(pair) for pair in parts]), param)
        else:  # embedding and LM head: vocabulary rows (the last rank's tail is padding)
            assert a.shape[1] == hidden and torch.equal(torch.cat([a, b])[: param.shape[0]], param)


def test_a_dead_worker_stops_the_engine_with_a_clear_error(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **OPTIONS)
    worker = llm.engine.workers.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 died \(exit code -9\)"):
        llm.generate(PROMPTS, GREEDY)
    assert time.monotonic() - start < 30
    with pytest.raises(WorkerError):  # and it stays down
        llm.generate(PROMPTS[:1], GREEDY)
    llm.shutdown()


def test_two_engines_on_one_host_and_no_orphans_after_shutdown(tiny_llama_dir):
    """Each engine's rendezvous port is picked free, so two run side by side; shutdown ends every worker."""
    with LLM(str(tiny_llama_dir), tensor_parallel_size=2, **OPTIONS) as a, \
         LLM(str(tiny_llama_dir), tensor_parallel_size=2, **OPTIONS) as b:
        workers = a.engine.workers.processes + b.engine.workers.processes
        assert all(p.is_alive() for p in workers)
        assert a.generate(PROMPTS[:2], GREEDY)[0].outputs[0].token_ids == \
            b.generate(PROMPTS[:2], GREEDY)[0].outputs[0].token_ids
    assert not any(p.is_alive() for p in workers)


@pytest.mark.parametrize(("option", "value", "message"), [
    ("tensor_parallel_size", 3, "must divide the number of attention heads"),
    ("tensor_parallel_size", 0, "must be >= 1"),
])
def test_invalid_tensor_parallel_sizes_are_refused(tiny_llama_dir, option, value, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama_dir), **{option: value}, **OPTIONS)


@pytest.mark.slow
def test_smollm2_tp3_greedy_tokens_equal_tp1_fp32():
    """The real model, fp32. SmolLM2-135M has 9 attention heads and 3 KV heads, so 3 ranks (one KV head each) is
    its smallest split; the pool is small enough to preempt, and the second round hits the prefix cache."""
    options = dict(dtype="float32", block_size=16, num_kv_blocks=10, max_model_len=128, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(**parallel):
        with LLM("SmolLM2-135M-Instruct", **options, **parallel) as llm:
            outputs = llm.generate(PROMPTS, params) + llm.generate(PROMPTS[:4], params)
        return ([out.outputs[0].token_ids for out in outputs], sum(out.metrics.num_preemptions for out in outputs),
                sum(out.num_cached_tokens for out in outputs))

    expected = run()
    assert expected[1] > 0 and expected[2] > 0
    assert run(tensor_parallel_size=3) == expected
