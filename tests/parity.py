"""Checking the engine against transformers: prompts, reference generation and one-step logits, shared by the
parity tests of every model family."""

from dataclasses import dataclass, field

import pytest
import torch
import transformers
from conftest import torch_threads

from liteinfer import LLM, SamplingParams
from liteinfer.engine.scheduler import ScheduledBatch
from liteinfer.engine.sequence import Sequence
from liteinfer.layers import FULL, SLIDING

NUM_NEW = 48  # greedy tokens compared with transformers
BLOCK_SIZE = 16  # the engine default
PROMPTS = [
    "Hello",  # 1 token
    "The capital of France is",  # 5 tokens
    # 27 tokens: crosses a block boundary
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of "
    "worms",
    # 47 tokens: with NUM_NEW it runs past the llama3 variant's original_max_position_embeddings (64)
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was",
]
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Import into a test module to run it on one thread: the models are tiny, and thread hand-offs cost far more
    than the maths (10-100x slower on a loaded machine). The results do not depend on it."""
    with torch_threads(1):
        yield


def all_blocks_free(llm: LLM) -> bool:
    manager = llm.engine.block_manager
    return manager.num_free_blocks == manager.num_blocks and not any(manager.ref_counts)


@torch.inference_mode()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] float32 logits of one unpadded sequence."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(hf_model, prompt_ids: list[int], num_new: int) -> list[int]:
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            min_new_tokens=num_new,
            max_new_tokens=num_new,
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def prefill_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every position's logits of each prompt, from one engine step that prefills them all together."""
    engine = llm.engine
    batch = ScheduledBatch()
    for i, ids in enumerate(prompts):
        seq = Sequence(f"logits-{i}", 0, list(ids), len(ids), SamplingParams(), 1, detokenizer=None)
        assert engine.block_manager.allocate(seq.block_table, len(ids))
        batch.add(seq, len(ids))
    try:
        input_ids, meta, _, _ = engine.runner._prepare(batch)
        assert meta.num_decodes == 0  # each prompt one span, laid in the batch's order
        with torch.inference_mode():
            model = engine.runner.model
            logits = model.compute_logits(model(input_ids, meta.positions, meta))
    finally:
        for seq in batch.seqs:
            engine.block_manager.free(seq.block_table)
    assert logits.shape[0] == sum(map(len, prompts))
    return list(logits.split([len(ids) for ids in prompts]))


@dataclass(frozen=True)
class Variant:
    """A tiny model of one family: its transformers classes, the config options that switch its features on (on
    top of COMMON), and the prompts it is checked on."""

    architecture: str
    config_class: str
    options: dict
    prompts: list[str] = field(default_factory=lambda: PROMPTS)


COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def make_tiny_model(directory, tokenizer, variant: Variant, seed: int = 0):
    """Save a random-weight transformers model of `variant` with the SmolLM2 tokenizer; return it."""
    config = getattr(transformers, variant.config_class)(
        **{
            "vocab_size": len(tokenizer),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            **COMMON,
            **variant.options,
        }
    )
    config.architectures = [variant.architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, variant.architecture)(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                # Peaked, trained-like logits, so that greedy choices are not near-ties (see make_tiny_llama).
                param.normal_(0, 0.2)
            else:
                # Biases and norm weights off their initial zeros and ones, so that loading them is checked.
                param.add_(torch.randn_like(param), alpha=0.1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


WINDOW = 16  # smaller than the longer prompts, and than every prompt plus its NUM_NEW tokens
# Longer than Phi-3 long-rope's original context (32 tokens) below; 47 and 49 tokens.
LONG_PROMPTS = [
    PROMPTS[3],
    PROMPTS[2] + " and an oozy smell, nor yet a dry, bare, sandy hole with nothing in it to sit down on",
]


def longrope(**extra) -> dict:
    """Phi-3's long-rope parameters as both Phi-3 variants below take them: short and long factors (one per rotated
    pair of head_dim 16) far enough apart that the rotation shows which of them applies."""
    def factors(step: float) -> list[float]:
        return [1.0 + step * i for i in range(8)]

    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": factors(0.1), "long_factor": factors(0.5),
            **extra}


# Every supported family other than Llama, with every feature the family has switched on (tests/integration/
# test_model_families.py checks each against transformers).
FAMILY_VARIANTS = {
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
    # YaRN as Qwen's model cards add it for long contexts: every position rotates with its frequencies, the slow pairs
    # interpolated by `factor`, the fast ones kept, a ramp between; cos and sin scaled by the attention factor.
    "qwen2-yarn": Variant(
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 32, "beta_fast": 8.0},
            tie_word_embeddings=True,
        ),
        LONG_PROMPTS,
    ),
    # Long-rope both ways (see layers/rotary.py): a context within the original one rotates with the short
    # factors, a longer one with the long factors, which transformers uses for prompts longer than the original.
    "phi3-short": Variant(
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(
            original_max_position_embeddings=512,
            rope_parameters=longrope(attention_factor=1.2),
            sliding_window=WINDOW,
            tie_word_embeddings=False,
        ),
    ),
    "phi3-long": Variant(
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(
            original_max_position_embeddings=32,
            rope_parameters=longrope(),
            tie_word_embeddings=False,
        ),
        LONG_PROMPTS,
    ),
}
