"""Tensor parallelism on CUDA (run where a GPU is lent): one rank through the sharded layers gives the CPU's greedy
tokens; two ranks over NCCL give one rank's, where two devices are visible."""

import pytest
import torch

from liteinfer import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
OPTIONS = dict(dtype="float32", num_kv_blocks=64, max_model_len=128)


def greedy(directory, **options) -> list[list[int]]:
    with LLM(str(directory), **OPTIONS, **options) as llm:
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]


def test_cuda_tp1_greedy_tokens_equal_cpu(tiny_llama):
    directory, _ = tiny_llama
    assert greedy(directory, device="cuda", tensor_parallel_size=1) == greedy(directory, device="cpu")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_tp2_nccl_greedy_tokens_equal_tp1(tiny_llama):
    directory, _ = tiny_llama
    assert greedy(directory, device="cuda", tensor_parallel_size=2) == greedy(directory, device="cuda")
