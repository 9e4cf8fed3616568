"""An engine's greedy tokens from its head screened in bytes (layers/greedy_head.py) against the same engine with the
full head, in fp32 and bf16: the same tokens, min_tokens' held-back argmax included; steps with a row that samples or
wants logprobs compute the logits."""

import pytest
import torch

from liteinfer import LLM, SamplingParams, kernels

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not (kernels.load() and kernels.head_screen_available()
                            and kernels.packed_linear_available(torch.float32)),
                       reason="the head is screened on CPUs with AVX-512 VNNI whose packed linear takes it"),
]

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,", "Hello"]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def llm(tiny_llama_dir, request) -> LLM:
    return LLM(str(tiny_llama_dir), dtype=request.param, max_model_len=256)


def screened_calls(llm: LLM, prompts, params) -> tuple[list[list[int]], int]:
    """Each output's tokens, and how many times the head's candidates were screened."""
    with torch.profiler.profile() as profile:
        outputs = llm.generate(prompts, params)
    calls = sum(event.count for event in profile.key_averages() if event.key == "liteinfer::head_screen")
    return [out.outputs[0].token_ids for out in outputs], calls


def test_screened_greedy_tokens_are_the_full_heads(llm):
    head = llm.engine.runner.model.lm_head
    if head.screened is None:
        pytest.skip("bf16 heads multiply in AMX tiles here, unscreened")
    eos = llm.engine.tokenizer.eos_token_id
    # min_tokens with the EOS forced likely: held back, its row's logits decide as the sampler's masked argmax.
    params = [SamplingParams(temperature=0, max_tokens=24, min_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, min_tokens=8, stop_token_ids=[eos, 30, 31]),
              SamplingParams(temperature=0, max_tokens=24)]
    screened, calls = screened_calls(llm, PROMPTS * 3, params * 5)
    assert calls > 0
    head.screened, saved = None, head.screened
    try:
        full, no_calls = screened_calls(llm, PROMPTS * 3, params * 5)
    finally:
        head.screened = saved
    assert no_calls == 0
    assert screened == full


def test_steps_that_need_logits_compute_them(llm):
    prompts = PROMPTS[:2]
    for params in (SamplingParams(temperature=0.8, seed=1, max_tokens=4),
                   SamplingParams(temperature=0, logprobs=2, max_tokens=4),
                   SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=4)):
        _, calls = screened_calls(llm, prompts, params)
        assert calls == 0, params
