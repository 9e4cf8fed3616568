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
    GREEDY,
    NUM_NEW,
    PROMPTS,
    Variant,
    all_blocks_free,
    hf_greedy,
    make_tiny_model,
    one_torch_thread,  # noqa: F401 - an autouse fixture
    prefill_logits,
)

from liteinfer import LLM
from liteinfer.layers import FULL, SLIDING
from liteinfer.layers.linear import unpack_weight

WINDOW = 16  # smaller than the longer prompts, and than every prompt plus its NUM_NEW tokens
# Longer than Phi-3 long-rope's original context (32 tokens) below; 47 and 49 tokens.
LONG_PROMPTS = [
    PROMPTS[3],
    PROMPTS[2] + " and an oozy smell, nor yet a dry, bare, sandy hole with nothing in it to sit down on",
]


def rope_factors(step: float) -> list[float]:
    return [1.0 + step * i for i in range(8)]  # head_dim 16: one factor per rotated pair


VARIANTS = {
    "qwen2": Variant(
        "Qwen2ForCausalLM",
        "Qwen2Config",
        # q/k/v biases always; layer 1 slides (layers from max_window_layers on do); tied head like Qwen2.5-0.5B.
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=True),
    ),
    "qwen3": Variant(
        "Qwen3ForCausalLM",
        "Qwen3Config",
        # head_dim 32 while hidden_size / heads is 16; attention_bias puts biases on q/k/v/o too.
        dict(
            head_dim=32,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
            tie_word_embeddings=False,
        ),
    ),
    "mistral": Variant(
        "MistralForCausalLM", "MistralConfig", dict(head_dim=16, sliding_window=WINDOW, tie_word_embeddings=False)
    ),
    "gemma2": Variant(
        "Gemma2ForCausalLM",
        "Gemma2Config",
        # Caps low enough to bite; query_pre_attn_scalar unlike head_dim so that the scale shows.
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
            sliding_window=WINDOW,
            layer_types=[SLIDING, FULL],
            tie_word_embeddings=True,
        ),
    ),
    "gemma3": Variant(
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=3,
            head_dim=32,
            query_pre_attn_scalar=24,
            final_logit_softcapping=10.0,
            sliding_window=WINDOW,
            layer_types=[SLIDING, SLIDING, FULL],
            # Local layers rotate at their own base; global ones with linear scaling, as the larger Gemma 3s do.
            rope_parameters={
                SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            },
            tie_word_embeddings=False,
        ),
    ),
    # Long-rope both ways (see layers/rotary.py): a context within the original one rotates with the short
    # factors, a longer one with the long factors, which transformers uses for prompts longer than the original.
    "phi3-short": Variant(
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(
            original_max_position_embeddings=512,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": rope_factors(0.1),
                "long_factor": rope_factors(0.5),
                "attention_factor": 1.2,
            },
            sliding_window=WINDOW,
            tie_word_embeddings=False,
        ),
    ),
    "phi3-long": Variant(
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(
            original_max_position_embeddings=32,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": rope_factors(0.1),
                "long_factor": rope_factors(0.5),
            },
            tie_word_embeddings=False,
        ),
        LONG_PROMPTS,
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def family(request, tmp_path_factory, smollm2_tokenizer):
    """(variant, model directory, transformers model)."""
    variant = VARIANTS[request.param]
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
