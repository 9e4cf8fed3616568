"""Every supported family other than Llama against transformers, on tiny random-weight models.

Each model is built by transformers from a config of its family with every feature the family has switched on
(biases, q/k norm, soft-capping, sliding windows smaller than the sequences, per-layer-type rope, long-rope past
its original context, tied or untied head), saved the Hugging Face way and loaded by the engine, which runs with
prefix caching on. Logits must agree at fp32 and greedy tokens must be identical, one prompt at a time, batched
(by then the prompts' blocks are cached, so this also runs from prefix-cache hits) and in small prefill chunks.
"""

import pytest
import torch
from parity import (
    BLOCK_SIZE,
    FAMILY_VARIANTS,
    GREEDY,
    NUM_NEW,
    PROMPTS,
    all_blocks_free,
    hf_greedy,
    make_tiny_model,
    one_torch_thread,  # noqa: F401 - an autouse fixture
    prefill_logits,
)

from liteinfer import LLM, SamplingParams
from liteinfer.layers import FULL, SLIDING
from liteinfer.layers.linear import unpack_weight


@pytest.fixture(scope="module", params=list(FAMILY_VARIANTS))
def family(request, tmp_path_factory, smollm2_tokenizer):
    """(variant, model directory, transformers model)."""
    variant = FAMILY_VARIANTS[request.param]
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return variant, directory, make_tiny_model(directory, smollm2_tokenizer, variant)


@pytest.fixture(scope="module")
def llm(family):
    _, directory, _ = family
    return LLM(str(directory), dtype="float32", num_kv_blocks=128, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def reference(family, llm):
    """Per prompt: (prompt ids, transformers' greedy tokens)."""
    variant, _, hf_model = family
    refs = {}
    for prompt in variant.prompts:
        ids = llm.tokenizer.encode(prompt)
        refs[prompt] = ids, hf_greedy(hf_model, ids, NUM_NEW)
    return refs


def test_family_loads_as_its_own_class_with_its_features(family, llm):
    variant, _, hf_model = family
    model = llm.engine.runner.model
    assert type(model).__name__ == variant.architecture
    config = hf_model.config
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    sliding = [SLIDING if config.sliding_window else FULL] * config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None) or sliding
    assert windows == [config.sliding_window if kind == SLIDING else None for kind in layer_types]
    # A tied head loads as the embeddings' Parameter; on the CPU it then holds a packed copy of those values.
    head = model.lm_head.weight
    head = head.to_dense() if head.is_mkldnn else unpack_weight(head) if head.dim() == 4 else head
    assert torch.equal(head, model.model.embed_tokens.weight) == config.tie_word_embeddings
    if config.rope_parameters.get("rope_type") == "yarn":  # the context YaRN was made for, as vLLM serves it
        assert llm.engine.max_model_len == 32 * 4


def test_family_forward_logits_match_transformers_fp32(family, llm):
    """One step prefilling two prompts of different lengths, every position's logits."""
    variant, _, hf_model = family
    prompts = [llm.tokenizer.encode(prompt) for prompt in variant.prompts[-2:]]
    for ids, logits in zip(prompts, prefill_logits(llm, prompts), strict=True):
        with torch.no_grad():
            expected = hf_model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-5)
    assert all_blocks_free(llm)


@pytest.fixture(scope="module")
def greedy_single(family, llm):
    variant, _, _ = family
    return {prompt: llm.generate(prompt, GREEDY)[0] for prompt in variant.prompts}


def test_family_greedy_single_matches_transformers(reference, greedy_single):
    for prompt, out in greedy_single.items():
        prompt_ids, expected = reference[prompt]
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == expected, prompt


def test_family_greedy_batched_matches_transformers(family, llm, reference, greedy_single):
    # The single runs left every prompt's full blocks in the prefix cache: these prefills start from hits.
    variant, _, _ = family
    outs = llm.generate(variant.prompts, GREEDY)
    for prompt, out in zip(variant.prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference[prompt][1], prompt
        assert out.outputs[0].text == greedy_single[prompt].outputs[0].text
    assert sum(out.num_cached_tokens for out in outs) > 0
    assert all_blocks_free(llm)


def test_family_greedy_chunked_prefill_matches_transformers(family, reference):
    """Prompts computed BLOCK_SIZE tokens a step: windows and rope must hold across chunk boundaries."""
    variant, directory, _ = family
    chunked = LLM(
        str(directory),
        dtype="float32",
        num_kv_blocks=128,
        enable_prefix_caching=False,
        max_num_batched_tokens=BLOCK_SIZE * 2,
        long_prefill_token_threshold=BLOCK_SIZE,
    )
    outs = chunked.generate(variant.prompts, GREEDY)
    for prompt, out in zip(variant.prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference[prompt][1], prompt


def test_long_rope_served_within_its_original_context_takes_the_short_factors(tmp_path, smollm2_tokenizer):
    """The context served decides, not the config's limit: Phi-3 with max_model_len within its original context
    (32 of 512) never sees a position past it, and rotates with the short factors, as transformers does for such
    sequences (a config limit of 128k made Phi-3-mini-128k take the long ones even at max_model_len=4096)."""
    variant = FAMILY_VARIANTS["phi3-long"]
    hf_model = make_tiny_model(tmp_path, smollm2_tokenizer, variant)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=32, max_model_len=32)
    for prompt in PROMPTS[:3]:
        prompt_ids = llm.tokenizer.encode(prompt)
        num_new = 32 - len(prompt_ids)
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=num_new, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt_ids, num_new), prompt
