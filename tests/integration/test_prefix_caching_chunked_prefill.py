"""Prefix caching and chunked prefill change how much is computed per step, never the tokens."""

from dataclasses import replace

import pytest
from conftest import assert_same_prompt_scores, sampled_logprobs

from liteinfer import LLM, SamplingParams, kernels

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SYSTEM = (
    "You are a careful assistant. Answer briefly, cite the facts you rely on, and say so when you are unsure. "
    "Prefer plain words to jargon and short sentences to long ones. "
)
QUESTIONS = ["What is the capital of France?", "How do bees make honey?", "Why is the sea salty?"]
# Shared long prefixes, an exact repeat, a prompt with nothing in common, and one far longer than the chunks.
PROMPTS = [SYSTEM + q for q in QUESTIONS] + [SYSTEM + QUESTIONS[0], "Tell me a joke.", SYSTEM * 4 + "Summarise."]


def make_llm(directory, **options) -> LLM:
    return LLM(str(directory), dtype="float32", num_kv_blocks=256, block_size=16, max_model_len=512, **options)


def token_ids(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def plain(tiny_llama):
    """The plain path: no prefix caching, no chunking, each prompt computed in one step."""
    directory, _ = tiny_llama
    llm = make_llm(directory, enable_prefix_caching=False, enable_chunked_prefill=False)
    return token_ids(llm.generate(PROMPTS, GREEDY))


def test_prefix_caching_on_off_same_greedy_tokens(tiny_llama, plain):
    directory, _ = tiny_llama
    llm = make_llm(directory, enable_prefix_caching=True, enable_chunked_prefill=False)
    first = llm.generate(PROMPTS, GREEDY)  # the repeat and shared prefixes can hit within one call
    second = llm.generate(PROMPTS, GREEDY)  # now every prompt's full blocks are cached
    assert token_ids(first) == plain
    assert token_ids(second) == plain
    block = 16
    for out in second:
        assert out.num_cached_tokens == (len(out.prompt_token_ids) - 1) // block * block
    # All prompts are admitted in one step of the first call, before anything is cached: hits come in the second.
    assert sum(out.num_cached_tokens for out in first) == 0
    looked_up = sum(len(out.prompt_token_ids) for out in first + second)
    hits = sum(out.num_cached_tokens for out in second)
    assert llm.engine.scheduler.prefix_hit_rate == pytest.approx(hits / looked_up)


def test_prefix_caching_off_reports_no_cached_tokens(tiny_llama):
    directory, _ = tiny_llama
    llm = make_llm(directory, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS[:2] * 2, GREEDY)
    assert all(out.num_cached_tokens == 0 for out in outs)
    assert llm.engine.scheduler.prefix_hit_rate == 0.0


def test_a_prompt_preempted_before_its_first_token_counts_no_hit_of_its_own_blocks(tiny_llama_dir):
    """num_cached_tokens is what the prefix cache held at a request's first admission (vLLM's): the blocks a prompt
    computed itself before a preemption, found again when it comes back, are not hits."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=96, block_size=16, max_num_batched_tokens=8,
              num_kv_blocks=7)
    engine = llm.engine
    # The first request's growth preempts the second in the middle of its prompt, which shares no token with it.
    engine.add_request("grows", {"prompt_token_ids": list(range(100, 140))}, replace(GREEDY, max_tokens=55))
    engine.add_request("preempted", {"prompt_token_ids": list(range(1000, 1080))}, replace(GREEDY, max_tokens=2))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    preempted = finished["preempted"]
    assert preempted.metrics.num_preemptions > 0 and preempted.outputs[0].token_ids
    assert preempted.num_cached_tokens == 0


def test_prefix_caching_fully_cached_prompt_computes_its_last_token(tiny_llama, plain):
    directory, _ = tiny_llama
    llm = make_llm(directory)
    prompt_ids = llm.tokenizer.encode(PROMPTS[0])
    # A prompt of exactly 3 blocks: all of it is cached after the first run except the block of its last token.
    ids = prompt_ids[:48]
    first = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]
    again = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]
    assert again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_prefix_caching_chat_turn_reuses_previous_turn(tiny_llama):
    directory, _ = tiny_llama
    llm = make_llm(directory)
    turn = [{"role": "user", "content": SYSTEM + QUESTIONS[1]}]
    reply = llm.chat(turn, GREEDY)[0]
    follow_up = turn + [
        {"role": "assistant", "content": reply.outputs[0].text},
        {"role": "user", "content": "And why?"},
    ]
    second = llm.chat(follow_up, GREEDY)[0]
    assert second.num_cached_tokens >= (len(reply.prompt_token_ids) // 16 - 1) * 16


def test_prefix_caching_n_samples_and_cache_hits_free_every_block(tiny_llama):
    directory, _ = tiny_llama
    llm = make_llm(directory)
    params = SamplingParams(n=3, temperature=0.9, seed=3, max_tokens=12)
    outs = llm.generate(PROMPTS[:4], params)
    assert [len(out.outputs) for out in outs] == [3] * 4
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks and not any(manager.ref_counts)


def test_chunked_prefill_on_off_same_greedy_tokens(tiny_llama, plain):
    directory, _ = tiny_llama
    # A budget of 32 tokens per step splits every prompt here into several chunks.
    llm = make_llm(directory, enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=32)
    assert max(len(llm.tokenizer.encode(p)) for p in PROMPTS) > 4 * 32
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == plain


def test_chunked_prefill_with_prefix_caching_and_preemption_same_greedy_tokens(tiny_llama, plain):
    directory, _ = tiny_llama
    # A pool just big enough for one full-length sequence: requests preempt each other while chunking.
    llm = LLM(str(directory), dtype="float32", block_size=16, max_model_len=256, num_kv_blocks=16,
              max_num_batched_tokens=48, enable_prefix_caching=True, enable_chunked_prefill=True)
    outs = llm.generate(PROMPTS, GREEDY)
    assert token_ids(outs) == plain
    assert sum(out.metrics.num_preemptions for out in outs) > 0


def test_prompt_logprobs_do_not_depend_on_caching_chunking_or_preemption(tiny_llama):
    """A request asking for prompt_logprobs computes its whole prompt, cached or not: the same values whether its
    prompt was cached before (then not looked up), chunked, or computed again after a preemption; n = 3 gives them
    once, from the first sample; the generated tokens are those of the plain path."""
    directory, _ = tiny_llama
    params = replace(GREEDY, prompt_logprobs=2)
    whole = make_llm(directory, enable_prefix_caching=False, enable_chunked_prefill=False)
    expected = [out.prompt_logprobs for out in whole.generate(PROMPTS, params)]
    cached = make_llm(directory, enable_prefix_caching=True, max_num_batched_tokens=32)
    cached.generate(PROMPTS, GREEDY)  # every prompt's full blocks cached
    for n in (1, 3):
        outputs = cached.generate(PROMPTS, replace(params, n=n))
        assert all(out.num_cached_tokens == 0 for out in outputs)
        assert_same_prompt_scores(outputs, expected)
    # As the preemption test above: requests preempt each other while their prompts are chunked.
    tight = LLM(str(directory), dtype="float32", block_size=16, max_model_len=256, num_kv_blocks=16,
                max_num_batched_tokens=48, enable_prefix_caching=True, enable_chunked_prefill=True)
    outputs = tight.generate(PROMPTS, params)
    assert sum(out.metrics.num_preemptions for out in outputs) > 0
    assert_same_prompt_scores(outputs, expected)
    assert token_ids(outputs) == token_ids(whole.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_prompt_token_computed_alone_gives_the_whole_prompts_logprobs(tiny_heads_64, kv_cache_dtype):
    """A prompt's last token computed on its own (a one-token chunk, a forked sample's tail) takes the prompt path as
    the whole prompt does, not the decode kernel, which rounds otherwise (with int8 pools, the query to 8 bits): the
    same log-probabilities to the bit, and a greedy n = 3 request's samples all alike."""
    kernels.load()
    if not kernels.prefill_available() or (kv_cache_dtype == "int8" and not kernels.int8_pools_available()):
        pytest.skip("the same prompt path for a whole prompt and a token alone needs our prompt kernel (AVX-512)")
    prompt = {"prompt_token_ids": list(range(100, 133))}  # two blocks of 16 and one token
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)

    def samples(llm: LLM, n: int = 1) -> list[tuple[list[int], list[float]]]:
        outputs = llm.generate(prompt, replace(params, n=n))[0].outputs
        return [(out.token_ids, sampled_logprobs(out)) for out in outputs]

    options = dict(dtype="float32", block_size=16, max_model_len=128, kv_cache_dtype=kv_cache_dtype)
    whole = LLM(str(tiny_heads_64), enable_prefix_caching=False, enable_chunked_prefill=False, **options)
    chunked = LLM(str(tiny_heads_64), enable_prefix_caching=False, max_num_batched_tokens=16,
                  long_prefill_token_threshold=16, **options)  # chunks of 16, 16 and 1
    expected = samples(whole)
    assert samples(chunked) == expected
    assert samples(whole, n=3) == expected * 3  # samples 1 and 2 compute the last token after the shared blocks


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_preempted_sequence_computes_its_generated_tokens_again_as_decodes(tiny_heads_64, kv_cache_dtype):
    """After a preemption, a sequence's generated tokens are computed again as the decodes they first were (several
    of one sequence in one step), not in its prompt's span, whose kernel rounds otherwise (with int8 pools the decode
    kernel rounds the query to 8 bits): the same log-probabilities to the bit as in a pool that never runs out."""
    kernels.load()
    if not kernels.available() or (kv_cache_dtype == "int8" and not kernels.int8_pools_available()):
        pytest.skip("decodes that do not depend on the rows beside them need our decode kernel")
    prompts = [{"prompt_token_ids": list(range(first, first + 33))} for first in (100, 200)]  # 3 blocks each
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    options = dict(dtype="float32", block_size=16, max_model_len=80, kv_cache_dtype=kv_cache_dtype,
                   enable_prefix_caching=False)

    def logprobs(outputs) -> list[list[float]]:
        return [sampled_logprobs(out.outputs[0]) for out in outputs]

    roomy = LLM(str(tiny_heads_64), num_kv_blocks=64, **options)
    # 7 blocks: both prompts start (3 + 3), then at position 48 the first takes the last block and the second,
    # with 15 tokens generated, is preempted; it computes its 33 + 15 tokens again once the first has finished.
    tight = LLM(str(tiny_heads_64), num_kv_blocks=7, **options)
    outputs = tight.generate(prompts, params)
    assert [out.metrics.num_preemptions for out in outputs] == [0, 1]
    assert logprobs(outputs) == logprobs(roomy.generate(prompts, params))


def test_chunked_prefill_new_request_gets_first_token_before_long_prefill_ends(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, enable_prefix_caching=False, max_num_batched_tokens=32)
    engine = llm.engine
    long_prompt = {"prompt_token_ids": llm.tokenizer.encode(SYSTEM * 4)}
    assert len(long_prompt["prompt_token_ids"]) > 4 * 32
    engine.add_request("long", long_prompt, GREEDY)
    engine.step()  # the long prompt's first chunk
    engine.add_request("short", "Hello!", GREEDY)
    steps = 1
    while not engine.requests["short"].seqs[0].output_token_ids:
        engine.step()
        steps += 1
    long_seq = engine.requests["long"].seqs[0]
    assert long_seq.num_computed_tokens < long_seq.num_prompt_tokens, "the long prefill had already finished"
    assert steps == 2  # the short request joined the very next step
    while engine.has_unfinished_requests():
        engine.step()
