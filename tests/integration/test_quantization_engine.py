"""Weight-only int8/int4 through the engine: the tiny model here; SmolLM2's agreement rate in the slow test."""

import pytest
import torch
from agreement import BUDGET, CONVERSATIONS, PARAMS, assert_agrees_with_fp32_as_closely_as_bf16, chat_tokens
from safetensors.torch import load_file

from liteinfer import LLM, SamplingParams
from liteinfer.config import DEFAULT_MODEL
from liteinfer.layers.linear import Linear
from liteinfer.layers.quantization import Int4Weight, Int8Weight
from liteinfer.models.loader import safetensors_files
from liteinfer.models.source import resolve_model

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,"]


def test_int8_engine_first_token_and_logprob_close_to_float(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    float_outs = LLM(str(tiny_llama_dir), dtype="float32").generate(PROMPTS, params)
    quantized = LLM(str(tiny_llama_dir), dtype="float32", quantization="int8")
    model = quantized.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)] + [model.lm_head]
    assert len(linears) > 1 and all(isinstance(m.quantized, Int8Weight) and m.weight is None for m in linears)
    for ref, out in zip(float_outs, quantized.generate(PROMPTS, params)):
        token = ref.outputs[0].token_ids[0]
        assert out.outputs[0].token_ids[0] == token  # the peaked tiny model's first choice survives int8
        assert abs(out.outputs[0].logprobs[0][token].logprob - ref.outputs[0].logprobs[0][token].logprob) < 0.1


def test_int4_engine_quantizes_every_linear_and_generates(tiny_llama_dir):
    # int4's coarse steps flip this random model's choices; its quality is checked on SmolLM2 in the slow test.
    llm = LLM(str(tiny_llama_dir), dtype="float32", quantization="int4")
    linears = [m for m in llm.engine.runner.model.modules() if hasattr(m, "quantized")]
    assert linears and all(m.quantized is not None and m.weight is None for m in linears)
    assert isinstance(llm.engine.runner.model.lm_head.quantized, Int8Weight)  # int4's head is int8
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [len(out.outputs[0].token_ids) for out in outs] == [8, 8]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_one_sequence_and_a_batch_compute_the_same_weights(tiny_llama_dir, method):
    # One kernel for any rows, a row's result independent of the others (tests/unit/test_gemv_kernel.py); batches of
    # five rows or more take another form than fewer (x rounded to 16-bit levels below five rows, not from five), so
    # the prompts here (five rows or more alone and together) and the decodes (fewer) meet one form either way.
    llm = LLM(str(tiny_llama_dir), dtype="float32", quantization=method)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    alone = llm.generate(PROMPTS[:1], params)[0].outputs[0]
    batched = llm.generate(PROMPTS, params)[0].outputs[0]
    assert alone.token_ids == batched.token_ids
    for ours, theirs, token in zip(alone.logprobs, batched.logprobs, alone.token_ids):
        assert abs(ours[token].logprob - theirs[token].logprob) < 2e-3


def test_quantization_on_cuda_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(tiny_llama_dir), quantization="int8", device="cuda")


# Quantized weights may flip a greedy choice only where the fp32 model's two candidates are this close (logits). On
# these prompts the fp32 top-2 gap has a median of ~1.4 (tests/integration/test_smollm2.py); per-row int8's flips were
# measured at most 0.2 apart and bf16's at most 0.09: rounding deciding a near-tie. A wrong scale or layer would flip
# clear choices.
NEAR_TIE = 0.5


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_smollm2_quantized_agrees_with_fp32_as_closely_as_bf16_does(method):
    """Greedy agreement with the fp32 model, measured as the tokens generated before the first divergence. The
    quantized weights are compared with the same model's fp32 weights (activations in fp32 for both), so the
    quantization is all that differs. Rounding alone (bf16) already flips this model's near-ties, so the quantized
    model is held to that yardstick, not to identity, and each of its first divergences must be at a near-tie of the
    fp32 logits; and, as the issue asks of int8, it keeps the greedy tokens of most prompts (measured: all 8 for both,
    whose groups of 32 hold the GGUF's own Q4_1 and Q8_0 levels)."""
    tokens = chat_tokens(LLM(**BUDGET, dtype="float32", quantization=method))
    identical = assert_agrees_with_fp32_as_closely_as_bf16(tokens, method, NEAR_TIE)
    assert identical > len(CONVERSATIONS) / 2


@pytest.mark.slow
def test_smollm2_int4_holds_its_fp32_weights_exactly():
    """SmolLM2's GGUF stores its layers as Q4_1 and its embeddings (the tied LM head) as Q8_0: int4 (whose head is
    int8) holds exactly the values the fp32 engine loads, so with fp32 activations it is the fp32 model, computed
    to fp32's accuracy in batches (tests/unit/test_gemv_kernel.py), rather than an approximation of it."""
    source = resolve_model(DEFAULT_MODEL)
    for file in safetensors_files(source.path):
        for name, weight in load_file(file).items():
            if weight.dim() == 2:
                weight_cls = Int8Weight if "embed_tokens" in name else Int4Weight
                assert torch.equal(weight_cls.dequantize_float(weight), weight), name


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_smollm2_quantized_in_bf16_answers(method):
    # bf16 prompts take another path than fp32's where the CPU has AMX (the weights dequantized to bf16 in tiles).
    quantized = LLM(**BUDGET, dtype="bfloat16", quantization=method).chat(CONVERSATIONS[:1], PARAMS)[0]
    assert "Paris" in quantized.outputs[0].text
