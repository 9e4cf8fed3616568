"""kv_cache_dtype="int8" through the engine (cache/kv_cache.py): SmolLM2 with int8 pools against its plain pools, read
by the kernels and on the gathered path where the kernels do not read int8 pools; the compiled step against the eager
one; the pool's capacity; the agreement rate over more prompts in the slow test. Random tiny models are no use here:
their greedy choices are near-ties that any rounding of the K/V flips."""

import pytest
import torch
from agreement import BUDGET, CHAT_QUESTIONS, assert_agrees_with_fp32_as_closely_as_bf16, chat_tokens, departure_gaps
from test_compiled import generated_code, loops_over_a_pool

from liteinfer import LLM, SamplingParams, kernels
from liteinfer.cache import KVCache
from liteinfer.engine.packaged import PackagedDecoder

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SMALL = {"max_model_len": 512, "kv_cache_memory_bytes": 64 << 20}  # the fast tests' engines
# int8 pools may flip a greedy choice only where the plain engine's two candidates are this close (logits), as
# int8 weights may (test_quantization_engine.py). Over the slow test's prompts they departed at gaps up to 0.25.
INT8_NEAR_TIE = 0.5


@pytest.fixture(scope="module")
def conversations():
    return [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS[:3]]


@pytest.fixture(scope="module")
def reference():
    return LLM(dtype="float32", **SMALL)


@pytest.fixture(scope="module")
def reference_tokens(reference, conversations):
    return [out.outputs[0].token_ids for out in reference.chat(conversations, GREEDY)]


def assert_departs_at_near_ties_only(llm, reference, reference_tokens, conversations):
    tokens = [out.outputs[0].token_ids for out in llm.chat(conversations, GREEDY)]
    prompts = [reference.apply_chat_template(conversation) for conversation in conversations]
    gaps = departure_gaps(reference, prompts, reference_tokens, tokens)
    assert all(gap < INT8_NEAR_TIE for gap in gaps), gaps


def test_int8_pools_read_by_the_kernels_depart_from_plain_ones_at_near_ties_only(reference, reference_tokens,
                                                                                  conversations):
    llm = LLM(dtype="float32", kv_cache_dtype="int8", **SMALL)
    attn = llm.engine.runner.model.model.layers[0].self_attn.attn
    assert attn.k_cache.dtype == torch.uint8 and attn.v_cache.dtype == torch.int8
    if not kernels.int8_pools_available():
        pytest.skip("the kernels read int8 pools on CPUs with AVX-512 VNNI only (the gathered path is tested below)")
    assert attn._kernels_take_pools()
    assert_departs_at_near_ties_only(llm, reference, reference_tokens, conversations)


def test_int8_pools_on_the_gathered_path_depart_from_plain_ones_at_near_ties_only(reference, reference_tokens,
                                                                                   conversations, monkeypatch):
    monkeypatch.setattr(kernels, "_int8_pools", False)  # as on a CPU without AVX-512 VNNI
    llm = LLM(dtype="float32", kv_cache_dtype="int8", **SMALL)
    assert not llm.engine.runner.model.model.layers[0].self_attn.attn._kernels_take_pools()
    assert_departs_at_near_ties_only(llm, reference, reference_tokens, conversations)


def test_int8_pools_hold_nearly_twice_the_tokens(tiny_heads_64):
    """A row of 64 elements takes 64 bytes and a 4-byte scale, against 128 bytes in bf16."""
    def tokens(**kv_cache):
        cache = LLM(str(tiny_heads_64), dtype="bfloat16", **SMALL, **kv_cache).engine.kv_cache
        return cache.num_blocks * cache.block_size

    assert tokens(kv_cache_dtype="int8") / tokens() == pytest.approx(128 / 68, rel=0.01)


@pytest.mark.usefixtures("one_torch_thread")
def test_compiled_step_reads_and_writes_int8_pools_in_place(tiny_heads_64):
    """The compiled decode step gives the eager engine's tokens (the same kernels and write, so the same rounding),
    and writes the pools (K, V and their scales) where they lie: no kernel loops over a whole pool."""
    engine = dict(dtype="float32", kv_cache_dtype="int8", **SMALL)
    prompts = ["The capital of France is", "Once upon a time, in a land far away,", "Hi"]
    engines = []
    code = generated_code(lambda: engines.append(LLM(str(tiny_heads_64), enforce_eager=False, **engine)))
    compiled, eager = engines[0], LLM(str(tiny_heads_64), **engine)
    tokens = [out.outputs[0].token_ids for out in compiled.generate(prompts, GREEDY)]
    assert tokens == [out.outputs[0].token_ids for out in eager.generate(prompts, GREEDY)]
    decoder, cache = compiled.engine.runner.compiled, compiled.engine.kv_cache
    if isinstance(decoder, PackagedDecoder):  # test_compiled.py's controls: each check sees such a loop
        assert all(loops_over_a_pool(decoder.package_path(one), first_pool_input=5) == [] for one in (True, False))
    else:
        for pool in (cache.k[0], cache.v[0], cache.k_scales[0]):
            assert f"{pool.numel()}L" not in code


def test_int8_pools_are_refused_where_they_cannot_run(tiny_heads_64):
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or int8"):
        LLM(str(tiny_heads_64), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="int8 runs on CPU"):
        LLM(str(tiny_heads_64), kv_cache_dtype="int8", device="cuda")
    with pytest.raises(ValueError, match="needs a head size divisible by 4, the model's is 6"):
        KVCache(1, 2, 16, 1, 6, torch.float32, torch.device("cpu"), int8=True)  # four elements of a key side by side


@pytest.mark.slow
def test_smollm2_int8_pools_agree_with_fp32_as_closely_as_bf16_does():
    """Greedy agreement with the plain fp32 engine: int8 pools under the fp32 model, held to bf16's yardstick."""
    int8 = chat_tokens(LLM(**BUDGET, dtype="float32", kv_cache_dtype="int8"))
    assert_agrees_with_fp32_as_closely_as_bf16(int8, "int8 pools", INT8_NEAR_TIE)
