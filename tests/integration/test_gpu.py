"""CUDA parity: the same engine on the GPU gives transformers' greedy tokens (run where a GPU is lent)."""

import pytest
import torch

from liteinfer import LLM, SamplingParams

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
