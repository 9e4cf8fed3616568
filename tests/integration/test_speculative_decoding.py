"""Speculative decoding (prompt lookup) changes how many tokens a step gives, never which: every sample equals the
plain engine's, greedy or seeded, with whatever else a request asks for."""

from dataclasses import replace

import pytest
from conftest import sampled_logprobs

from liteinfer import LLM, EngineConfig, SamplingParams, SpeculativeConfig, StructuredOutputsParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
# A random model's text rarely repeats itself, so few drafts would be kept; kept to a few tokens it does.
FEW_TOKENS = list(range(300, 305))
LOOPING = replace(GREEDY, allowed_token_ids=FEW_TOKENS)
PROMPTS = [
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "one two three four one two three four one two",
    "Tell me a story about a robot who learns to paint.",
    "a b c d e f g a b c d e f g a b c",
]


def make_llm(directory, **options) -> LLM:
    return LLM(str(directory), **{"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 128, "block_size": 16,
                                  **options})


def samples(outputs) -> list[tuple]:
    return [(s.token_ids, s.text, s.finish_reason, s.stop_reason) for out in outputs for s in out.outputs]


def logprobs(outputs) -> list[float]:
    """Each sampled token's logprob, of every sample in turn (with `samples` equal, the lists align)."""
    return [logprob for out in outputs for s in out.outputs for logprob in sampled_logprobs(s)]


@pytest.fixture(scope="module")
def engines(tiny_llama):
    directory, _ = tiny_llama
    return make_llm(directory), make_llm(directory, speculative_config=SPECULATIVE)


def test_greedy_tokens_and_logprobs_equal_the_plain_engines_with_drafts_kept(engines):
    plain, speculative = engines
    params = [GREEDY] * len(PROMPTS) + [LOOPING] * len(PROMPTS)
    want = plain.generate(PROMPTS * 2, params)
    got = speculative.generate(PROMPTS * 2, params)
    assert samples(got) == samples(want)
    # Each row of a speculative step is a decode at its own position: the same logits as a plain step's.
    assert logprobs(got) == pytest.approx(logprobs(want), abs=1e-5)
    stats = speculative.engine.stats()
    assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens > stats.spec_accepted_tokens  # both kinds met


def test_every_sampling_feature_sees_the_drafts_before_it(engines):
    """Penalties, min_tokens, bad words, stop strings and ids, max_tokens, n > 1 and seeded sampling: each row of a
    speculative step samples with the drafts before it counted as output, so each sample is the plain one."""
    plain, speculative = engines
    params = [
        replace(GREEDY, repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1),
        replace(GREEDY, ignore_eos=False, min_tokens=12, max_tokens=30),
        replace(GREEDY, bad_words=["the", " cat"]),
        replace(GREEDY, stop=[" mat.", "three"], include_stop_str_in_output=True),
        replace(GREEDY, stop_token_ids=[279], max_tokens=17),
        SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=3, n=3, max_tokens=40, ignore_eos=True,
                       logprobs=0),
        SamplingParams(temperature=1.5, min_p=0.01, seed=11, max_tokens=33, ignore_eos=True, logprobs=2),
        replace(GREEDY, logit_bias={279: 1.5, 264: -2.0}, allowed_token_ids=list(range(200, 2000))),
    ]
    params += [replace(p, allowed_token_ids=FEW_TOKENS) for p in params if p.allowed_token_ids is None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    want = plain.generate(prompts, params)
    got = speculative.generate(prompts, params)
    assert samples(got) == samples(want)
    assert logprobs(got) == pytest.approx(logprobs(want), abs=1e-5)
    assert speculative.engine.stats().spec_accepted_tokens > 0


def test_a_structured_output_does_not_speculate_and_runs_beside_those_that_do(engines):
    plain, speculative = engines
    formatted = replace(GREEDY, structured_outputs=StructuredOutputsParams(regex="(ab|cd){3,8}"), ignore_eos=False)
    params = [LOOPING, formatted, LOOPING]
    prompts = PROMPTS[:3]
    assert samples(speculative.generate(prompts, params)) == samples(plain.generate(prompts, params))


@pytest.mark.parametrize("options", [
    # A pool too small for all: sequences preempted and recomputed, drafts dropped where blocks run short.
    dict(num_kv_blocks=20, max_num_batched_tokens=64),
    # Chunks of prompts beside speculative decodes, and prompts found in the prefix cache.
    dict(max_num_batched_tokens=24, long_prefill_token_threshold=8),
    dict(scheduler="static", max_num_seqs=3),
], ids=["preempting", "chunked", "static"])
def test_preemption_chunking_and_static_batches_keep_the_plain_tokens(tiny_llama_dir, options):
    prompts = [p + suffix for p in PROMPTS for suffix in ("", " and then")]
    params = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, allowed_token_ids=FEW_TOKENS if i % 2
                             else None) for i in range(len(prompts))]
    want = make_llm(tiny_llama_dir).generate(prompts, params)
    llm = make_llm(tiny_llama_dir, speculative_config=SPECULATIVE, **options)
    for _ in range(2):  # the second call finds its prompts cached (all but static batching)
        assert samples(llm.generate(prompts, params)) == samples(want)
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks and not any(manager.ref_counts)
    assert llm.engine.stats().spec_accepted_tokens > 0


def test_a_prompt_whose_last_chunk_is_one_token_drafts_only_once_it_decodes(tiny_llama_dir):
    """Chunks of 16 leave the long prompt's last token for a step of its own, beside another's decode: that token
    is a prompt span, not a decode, and must not take drafts (its first draft row once sampled from the other
    sequence's row: a review's find)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=FEW_TOKENS)
    prompts = [{"prompt_token_ids": [700, 701, 702]}, {"prompt_token_ids": ([500, 501, 502] * 10)[:29]}]
    want = make_llm(tiny_llama_dir, max_num_batched_tokens=16).generate(prompts, [params, params])
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=16, speculative_config=SPECULATIVE)
    assert samples(llm.generate(prompts, [params, params])) == samples(want)
    assert llm.engine.stats().spec_draft_tokens > 0


def test_drafts_never_pass_max_tokens_or_the_context(tiny_llama_dir):
    """A sequence one token short of its max_tokens, or of the context, gets no drafts past it."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=48, num_kv_blocks=16, block_size=16,
              speculative_config=SPECULATIVE)
    prompt = {"prompt_token_ids": [500, 501, 502] * 12}  # a loop: drafts on every step
    outputs = llm.generate([prompt] * 2, [SamplingParams(temperature=0, ignore_eos=True, max_tokens=9),
                                          SamplingParams(temperature=0, ignore_eos=True)])
    assert [len(out.outputs[0].token_ids) for out in outputs] == [9, 48 - 36]
    assert [out.outputs[0].finish_reason for out in outputs] == ["length", "length"]


def test_no_drafts_while_the_batch_is_wider_than_disable_by_batch_size(tiny_llama_dir):
    """vLLM's disable_by_batch_size: three sequences decoding together get no drafts past a limit of two; once the
    batch narrows to the limit, the one left drafts again; the tokens are the plain engine's either way."""
    prompts = PROMPTS[:3]
    params = [replace(LOOPING, max_tokens=n) for n in (8, 8, 40)]
    want = make_llm(tiny_llama_dir).generate(prompts, params)
    llm = make_llm(tiny_llama_dir, speculative_config={**SPECULATIVE, "disable_by_batch_size": 2})
    drafted_while_wide = []
    step = llm.engine.step

    def counting_step():
        running = len(llm.engine.scheduler.running)
        outputs = step()
        if running > 2:
            drafted_while_wide.append(llm.engine.stats().spec_draft_tokens)
        return outputs

    llm.engine.step = counting_step
    assert samples(llm.generate(prompts, params)) == samples(want)
    assert drafted_while_wide and set(drafted_while_wide) == {0}
    assert llm.engine.stats().spec_accepted_tokens > 0  # the long one, alone at the end


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be 'ngram'"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "must not exceed"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max must be an integer >= 1"),
    ({"num_speculative_tokens": 2, "draft_model": "x"}, "has no field draft_model"),
    ({"prompt_lookup_max": 3}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must be None or an integer"),
    ("ngram", "must be a dict"),
])
def test_a_bad_speculative_config_is_refused_before_loading(value, message):
    with pytest.raises(ValueError, match=message):
        LLM("no-such-model", speculative_config=value)


def test_a_lookup_bound_left_out_takes_the_others_as_in_vllm():
    assert (SpeculativeConfig(2).prompt_lookup_min, SpeculativeConfig(2).prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig(2, prompt_lookup_max=3).prompt_lookup_min == 3
    assert SpeculativeConfig(2, prompt_lookup_min=2).prompt_lookup_max == 2
    assert EngineConfig(speculative_config={"num_speculative_tokens": 2}).speculative_config == SpeculativeConfig(2)


def test_tensor_parallel_ranks_compute_the_drafts_rows_alike(tiny_llama_dir):
    """TP=2 with speculative decoding gives TP=1's plain tokens: a step's draft rows reach every rank."""
    prompts = PROMPTS * 2
    params = [GREEDY] * len(PROMPTS) + [LOOPING] * len(PROMPTS)
    want = make_llm(tiny_llama_dir).generate(prompts, params)
    with make_llm(tiny_llama_dir, tensor_parallel_size=2, speculative_config=SPECULATIVE) as llm:
        assert samples(llm.generate(prompts, params)) == samples(want)
        assert llm.engine.stats().spec_accepted_tokens > 0
