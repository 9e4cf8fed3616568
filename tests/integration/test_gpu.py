"""CUDA parity: the same engine on the GPU gives transformers' greedy tokens (run where a GPU is lent)."""

from unittest import mock

import pytest
import torch

from liteinfer import LLM, SamplingParams
from liteinfer.layers import attention

pytestmark = pytest.mark.gpu


def test_cuda_fp32_greedy_matches_transformers(tiny_llama):
    directory, hf_model = tiny_llama
    llm = LLM(str(directory), device="cuda", dtype="float32")
    assert llm.engine.device.type == "cuda"
    prompts = ["The capital of France is", "Once upon a time, in a land far away,"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32, min_new_tokens=32)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()


def test_cuda_graphs_decode_gives_eager_greedy_tokens(tiny_llama_dir):
    """Decode steps replayed as CUDA graphs (batch padded to 1, 2, 4, ...; block tables to powers of two) give the
    eager engine's tokens, one request at a time and batched."""
    prompts = ["The capital of France is", "Once upon a time", "Hi", "a b c d e f g h i j k l m n o p q r s t u v w"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", max_model_len=512)
    eager = [out.outputs[0].token_ids for out in LLM(str(tiny_llama_dir), **options).generate(prompts, params)]
    llm = LLM(str(tiny_llama_dir), enforce_eager=False, **options)
    assert llm.engine.runner.compiled.cuda_graphs
    assert [out.outputs[0].token_ids for out in llm.generate(prompts, params)] == eager  # batch 4, then 3 ... 1
    assert [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts] == eager


def test_cuda_graphs_are_captured_at_start_for_a_ladder_of_batch_sizes(tiny_llama_dir):
    """The engine's start captures a graph for each batch size of the ladder (1, 2, 4, 8 for max_num_seqs=5); then
    every batch from 5 down to 1, at contexts across five block-table widths, replays one of them: no capture
    while requests run."""
    capture_begin = torch.cuda.CUDAGraph.capture_begin
    with mock.patch.object(torch.cuda.CUDAGraph, "capture_begin", autospec=True, side_effect=capture_begin) as capture:
        llm = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", enforce_eager=False, max_num_seqs=5,
                  max_model_len=512)
        assert llm.engine.runner.compiled.graph_batch_sizes == [1, 2, 4, 8]
        captured_at_start = capture.call_count
        # Each request stops 12 tokens after the one before it, so the batch shrinks a row at a time; the longest
        # reaches 5 + 72 tokens (blocks of 16: tables 1 to 5 wide).
        params = [SamplingParams(temperature=0, max_tokens=12 * (i + 2), ignore_eos=True) for i in range(5)]
        outputs = llm.generate(["The capital of France is"] * 5, params)
    assert [len(out.outputs[0].token_ids) for out in outputs] == [24, 36, 48, 60, 72]
    assert captured_at_start >= 4
    assert capture.call_count == captured_at_start


def test_cuda_attention_runs_our_triton_kernels(tiny_llama_dir):
    """Prompts and decodes on CUDA run our Triton kernels over the pool in place, not SDPA per span or the
    gathered-copy fallback (the tests above hold their tokens to transformers' and to eager's)."""
    assert attention.triton_paged_decode_attention is not None, "Triton is not installed"
    with (
        mock.patch.object(attention, "triton_paged_decode_attention",
                          wraps=attention.triton_paged_decode_attention) as decode_kernel,
        mock.patch.object(attention, "triton_paged_prefill_attention",
                          wraps=attention.triton_paged_prefill_attention) as prompt_kernel,
    ):
        LLM(str(tiny_llama_dir), device="cuda", dtype="float32").generate(
            ["The capital of France is"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert prompt_kernel.called and decode_kernel.called


def test_cuda_graphs_run_speculative_steps_with_the_eager_tokens(tiny_llama_dir):
    """A decode step with drafts (several rows of one sequence) replays the ladder's graphs, which reach
    max_num_seqs x (1 + k) rows, and gives the plain eager engine's tokens; nothing is captured while it runs."""
    prompts = ["The capital of France is", "Once upon a time", "Hi", "a b c d e f g h i j k l m n o p q r s t u v w"]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                             allowed_token_ids=list(range(300, 305)) if i % 2 else None) for i in range(4)]
    options = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=4)
    eager = [out.outputs[0].token_ids for out in LLM(str(tiny_llama_dir), **options).generate(prompts, params)]
    capture_begin = torch.cuda.CUDAGraph.capture_begin
    with mock.patch.object(torch.cuda.CUDAGraph, "capture_begin", autospec=True, side_effect=capture_begin) as capture:
        llm = LLM(str(tiny_llama_dir), enforce_eager=False, speculative_config={"num_speculative_tokens": 3,
                                                                               "prompt_lookup_min": 1}, **options)
        assert llm.engine.runner.compiled.graph_batch_sizes == [1, 2, 4, 8, 16]
        captured_at_start = capture.call_count
        assert [out.outputs[0].token_ids for out in llm.generate(prompts, params)] == eager
    assert capture.call_count == captured_at_start
    assert llm.engine.stats().spec_accepted_tokens > 0
