"""The engine end to end on tiny random Llamas: parity with transformers, scheduling, n > 1, seeds,
validation, abort, finish reasons and chat."""

import json
import math
import re
import shutil
from dataclasses import replace

import pytest
import torch
from parity import (
    BLOCK_SIZE,
    GREEDY,
    NUM_NEW,
    PROMPTS,
    all_blocks_free,
    hf_greedy,
    hf_logprobs,
    one_torch_thread,  # noqa: F401 - an autouse fixture
    prefill_logits,
)

from liteinfer import LLM, RequestOutput, RequestOutputKind, SamplingParams, StructuredOutputsParams
from liteinfer.engine import workers
from liteinfer.engine.llm_engine import bad_words_token_ids

# Prompts of at most 16 tokens, so that with max_model_len=64 each can generate NUM_NEW.
SHORT_PROMPTS = [
    "Hello",
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "My favourite colour is blue because",
    "1, 2, 3, 4, 5,",
    "The quick brown fox jumps over the lazy dog and then",
]


# ----------------------------------------------------------------------------------------------------------
# Parity with transformers, on every tiny Llama variant


@pytest.fixture(scope="module")
def parity(tiny_llama):
    """(LLM, transformers model) for one variant."""
    directory, hf_model = tiny_llama
    return LLM(str(directory), dtype="float32", num_kv_blocks=256), hf_model


@pytest.fixture(scope="module")
def reference(parity):
    """Per prompt: (prompt ids, transformers' greedy tokens)."""
    llm, hf_model = parity
    refs = {}
    for prompt in dict.fromkeys(PROMPTS + SHORT_PROMPTS):
        ids = llm.tokenizer.encode(prompt)
        refs[prompt] = ids, hf_greedy(hf_model, ids, NUM_NEW)
    return refs


def test_llama_forward_logits_match_transformers_fp32(parity):
    """One step prefilling two prompts of different lengths through the engine's model."""
    llm, hf_model = parity
    prompts = [llm.tokenizer.encode(PROMPTS[3]), llm.tokenizer.encode(PROMPTS[1])]
    for ids, logits in zip(prompts, prefill_logits(llm, prompts), strict=True):
        with torch.no_grad():
            expected = hf_model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert all_blocks_free(llm)


def test_llama_generated_logprobs_match_transformers_log_softmax(parity):
    """Prefill and decode steps of a batch: each reported logprob (sampled + top 5) is transformers' value."""
    llm, hf_model = parity
    num_top = 5
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=num_top)
    for out in llm.generate(PROMPTS, params):
        completion = out.outputs[0]
        prompt_len = len(out.prompt_token_ids)
        full = out.prompt_token_ids + completion.token_ids
        expected = hf_logprobs(hf_model, full[:-1])[prompt_len - 1 :]
        assert len(completion.logprobs) == len(completion.token_ids) == 8
        for step, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
            row = expected[step]
            top_ids = set(row.topk(num_top).indices.tolist())
            assert top_ids | {token} == set(position)
            assert token == int(row.argmax())  # greedy
            for token_id, logprob in position.items():
                assert logprob.logprob == pytest.approx(row[token_id].item(), abs=1e-4)
                assert logprob.rank == int((row > row[token_id]).sum()) + 1
        expected_sum = sum(expected[i, t].item() for i, t in enumerate(completion.token_ids))
        assert completion.cumulative_logprob == pytest.approx(expected_sum, abs=1e-3)


def test_llama_prompt_logprobs_match_transformers_log_softmax(parity, monkeypatch):
    """prompt_logprobs: each prompt token's logprob with the top 3 at its position (ranks and text too) is
    transformers' value, the first token's None; the generated tokens are those of a request without them. (The
    positions' logits computed and gathered 5 rows at a time, so that a step's come in several head calls: a long
    chunk's [rows, vocab] logits are never taken whole.)"""
    monkeypatch.setattr(workers, "SCORED_ROWS_AT_ONCE", 5)
    llm, hf_model = parity
    model, head_calls = llm.engine.runner.model, []
    monkeypatch.setattr(model, "compute_logits", lambda hidden, head=model.compute_logits: (
        head_calls.append(len(hidden)), head(hidden))[1])
    num_top = 3
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(PROMPTS, replace(params, prompt_logprobs=num_top))
    # The sampling rows (at most the 4 prompts) in one call, then the scored positions in calls of at most 5 rows.
    assert head_calls and max(head_calls) <= 5
    assert sum(head_calls) >= sum(len(out.prompt_token_ids) - 1 for out in outputs)
    assert [out.outputs[0].token_ids for out in outputs] == [
        out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]
    for out in outputs:
        prompt = out.prompt_token_ids
        expected = hf_logprobs(hf_model, prompt)  # row p: the distribution of token p + 1
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p, position in enumerate(out.prompt_logprobs[1:]):
            row, token = expected[p], prompt[p + 1]
            assert set(row.topk(num_top).indices.tolist()) | {token} == set(position)
            for token_id, logprob in position.items():
                value = row[token_id].item()
                assert logprob.logprob == pytest.approx(value, abs=1e-4)
                # A prompt token deep in a random model's distribution has thousands of neighbours within the two
                # implementations' rounding: its rank is checked up to those.
                assert int((row > value + 1e-4).sum()) < logprob.rank <= int((row > value - 1e-4).sum()) + 1
                assert logprob.decoded_token == llm.tokenizer.decode([token_id])
    assert all_blocks_free(llm)


@pytest.fixture(scope="module")
def greedy_single(parity):
    llm, _ = parity
    return {prompt: llm.generate(prompt, GREEDY)[0] for prompt in PROMPTS}


def test_llama_greedy_single_matches_transformers(reference, greedy_single):
    lengths = set()
    for prompt, out in greedy_single.items():
        prompt_ids, expected = reference[prompt]
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].finish_reason == "length"
        lengths.add(len(prompt_ids))
    assert len(lengths) == len(PROMPTS) and max(lengths) > 2 * BLOCK_SIZE


def test_llama_greedy_batched_matches_transformers_and_single(parity, reference, greedy_single):
    llm, _ = parity
    outs = llm.generate(PROMPTS, GREEDY)
    assert [out.prompt_token_ids for out in outs] == [reference[p][0] for p in PROMPTS]
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == reference[prompt][1], prompt
        assert out.outputs[0].token_ids == greedy_single[prompt].outputs[0].token_ids
        assert out.outputs[0].text == greedy_single[prompt].outputs[0].text
    assert all_blocks_free(llm)


@pytest.fixture(scope="module")
def short_unconstrained(parity):
    """SHORT_PROMPTS batched, greedy, in the default pool (room for every sequence at once)."""
    return parity[0].generate(SHORT_PROMPTS, GREEDY)


def test_llama_small_kv_pool_preempts_and_keeps_greedy_tokens(tiny_llama, short_unconstrained, reference):
    directory, _ = tiny_llama
    # 12 blocks of 16 tokens: 3 sequences at their full 64 tokens; all 8 are admitted at once and then grow.
    small = LLM(str(directory), dtype="float32", block_size=BLOCK_SIZE, max_model_len=64, num_kv_blocks=12)
    outs = small.generate(SHORT_PROMPTS, GREEDY)
    assert sum(out.metrics.num_preemptions for out in outs) > 0
    for prompt, out, free_out in zip(SHORT_PROMPTS, outs, short_unconstrained, strict=True):
        assert len(out.prompt_token_ids) + NUM_NEW <= 64
        assert out.outputs[0].token_ids == free_out.outputs[0].token_ids, prompt
        assert out.outputs[0].token_ids == reference[prompt][1], prompt
        assert out.outputs[0].finish_reason == "length"
    assert all_blocks_free(small) and not small.engine.has_unfinished_requests()


def test_llama_static_scheduler_matches_continuous_greedy(tiny_llama, short_unconstrained, reference):
    directory, _ = tiny_llama
    # A pool for 3 lifetimes at once: the 8 requests run as several static batches.
    static = LLM(str(directory), dtype="float32", scheduler="static", max_model_len=64, num_kv_blocks=12)
    outs = static.generate(SHORT_PROMPTS, GREEDY)
    for prompt, out, cont in zip(SHORT_PROMPTS, outs, short_unconstrained, strict=True):
        assert out.outputs[0].token_ids == cont.outputs[0].token_ids, prompt
        assert out.outputs[0].token_ids == reference[prompt][1], prompt
        assert out.metrics.num_preemptions == 0
    # Several batches ran one after another: the last was first scheduled after the first finished.
    assert outs[-1].metrics.first_scheduled_time >= outs[0].metrics.finished_time
    assert all_blocks_free(static)


# ----------------------------------------------------------------------------------------------------------
# Engine behaviour, on one variant

LONG_PROMPT = PROMPTS[3]  # 47 tokens: 2 full blocks can be shared by forked samples


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=128)


@pytest.fixture(autouse=True)
def _engine_is_idle_after_each_test(request):
    yield
    if "llm" in request.fixturenames:
        llm = request.getfixturevalue("llm")
        assert not llm.engine.has_unfinished_requests()
        assert all_blocks_free(llm)


def greedy(llm: LLM, prompt, **params):
    return llm.generate(prompt, SamplingParams(temperature=0, ignore_eos=True, **params))[0].outputs[0]


def test_llm_n3_seeded_returns_three_indexed_reproducible_samples(llm):
    params = SamplingParams(n=3, temperature=0.8, seed=1234, max_tokens=12)
    out = llm.generate(LONG_PROMPT, params)[0]
    assert out.finished
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # each sample has its own random stream
    again = llm.generate(LONG_PROMPT, params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_llm_n2_greedy_samples_equal_n1_greedy(llm):
    single = greedy(llm, LONG_PROMPT, max_tokens=24)
    out = llm.generate(LONG_PROMPT, SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1]
    # Sample 1 computes only the prompt's tail over sample 0's cached blocks: any error there would show.
    assert [c.token_ids for c in out.outputs] == [single.token_ids, single.token_ids]
    assert out.outputs[1].text == single.text


def test_llm_samples_waiting_with_their_prompt_blocks_do_not_stall_a_tight_pool(tiny_llama_dir, llm):
    """An n = 3 request's other samples wait (max_num_seqs = 2) holding its prompt's blocks; the older request
    preempts its first sample, and then needs more of the 6-block pool than the samples leave. They give their
    blocks up (the engine used to loop for ever here, the older request preempting itself); every greedy sample
    still equals n = 1's."""
    tight = LLM(str(tiny_llama_dir), dtype="float32", block_size=16, num_kv_blocks=6, max_model_len=96, max_num_seqs=2)
    older, first = {"prompt_token_ids": list(range(100, 116))}, {"prompt_token_ids": list(range(200, 233))}
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=64),
              SamplingParams(temperature=0, ignore_eos=True, max_tokens=47, n=3)]
    outs = tight.generate([older, first], params)
    assert outs[0].metrics.num_preemptions == 0 and outs[1].metrics.num_preemptions > 0
    assert outs[0].outputs[0].token_ids == greedy(llm, older, max_tokens=64).token_ids
    alone = greedy(llm, first, max_tokens=47).token_ids
    assert [c.token_ids for c in outs[1].outputs] == [alone] * 3
    assert all_blocks_free(tight)


def used_blocks(llm: LLM) -> int:
    manager = llm.engine.block_manager
    return manager.num_blocks - manager.num_free_blocks


def drain(engine) -> dict:
    finished = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_engine_reports_a_final_only_request_once_when_it_finishes(tiny_llama_dir):
    """What `LLM.generate` asks for: no step reports a FINAL_ONLY request until the one that finishes it, and that
    output equals its CUMULATIVE twin's, which every step reports."""
    engine = LLM(str(tiny_llama_dir), dtype="float32").engine
    params = dict(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("every", "Hello there", SamplingParams(**params))
    engine.add_request("final", "Hello there", SamplingParams(**params, output_kind=RequestOutputKind.FINAL_ONLY))
    steps = []
    while engine.has_unfinished_requests():
        steps.append({out.request_id: out for out in engine.step()})

    assert len(steps) == 5 and all("every" in step for step in steps)
    assert ["final" in step for step in steps] == [False] * 4 + [True]
    final, every = steps[-1]["final"], steps[-1]["every"]
    assert final.finished and final.outputs[0].token_ids == every.outputs[0].token_ids
    assert final.outputs[0].text == every.outputs[0].text and final.outputs[0].finish_reason == "length"


def test_engine_delta_outputs_add_up_to_the_cumulative_ones(tiny_llama_dir):
    """A DELTA request is reported at the same steps as its CUMULATIVE twin, each time with only what is new: its
    tokens, text and logprobs so far, joined, equal the twin's at every step (n > 1, stop strings holding text
    back, logprobs), and an abort's output carries only the rest."""
    engine = LLM(str(tiny_llama_dir), dtype="float32").engine
    params = dict(n=2, temperature=0.8, seed=3, max_tokens=12, logprobs=2, prompt_logprobs=1, stop=[" the", "ab"])
    kinds = {"cumulative": RequestOutputKind.CUMULATIVE, "delta": RequestOutputKind.DELTA}
    for name, kind in kinds.items():
        engine.add_request(name, "Hello there", SamplingParams(**params, output_kind=kind))
        engine.add_request(f"{name}-aborted", "Once upon", SamplingParams(**params, output_kind=kind))
    joined = {}  # (request id, sample) -> (token ids, text, logprobs) from the delta outputs so far
    prompt_scored = set()  # the twins whose delta output has carried the prompt's logprobs (its first one does)

    def check(outputs: list[RequestOutput]) -> None:
        """One report (a step's outputs, or the aborts'): the twins come together, and what is joined agrees."""
        by_id = {out.request_id: out for out in outputs}
        assert {name.replace("cumulative", "delta") for name in by_id if "cumulative" in name} == {
            name for name in by_id if "delta" in name}
        for twin in by_id.keys() & {"cumulative", "cumulative-aborted"}:
            every, delta = by_id[twin], by_id[twin.replace("cumulative", "delta")]
            assert delta.finished == every.finished
            assert len(every.prompt_logprobs) == len(every.prompt_token_ids)
            assert delta.prompt_logprobs == (None if twin in prompt_scored else every.prompt_logprobs)
            prompt_scored.add(twin)
            for whole, new in zip(every.outputs, delta.outputs, strict=True):
                tokens, text, logprobs = joined.get((twin, new.index), ([], "", []))
                joined[twin, new.index] = (tokens + new.token_ids, text + new.text, logprobs + new.logprobs)
                assert joined[twin, new.index] == (whole.token_ids, whole.text, whole.logprobs)
                assert (new.finish_reason, new.stop_reason) == (whole.finish_reason, whole.stop_reason)
                assert new.cumulative_logprob == whole.cumulative_logprob

    for num_steps in range(1, 100):
        if not engine.has_unfinished_requests():
            break
        check(engine.step())
        if num_steps == 4:
            check([engine.abort_request(f"{name}-aborted") for name in kinds])
    assert set(joined) == {(twin, index) for twin in ("cumulative", "cumulative-aborted") for index in (0, 1)}
    assert all(len(tokens) > 1 for tokens, _, _ in joined.values())  # a report adds one token a sample: several joined


def test_engine_n3_samples_share_prompt_blocks(tiny_llama_dir):
    # Prefix caching off: the sharing shown here is the fork's own, not a cache hit.
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=128,
              enable_prefix_caching=False)
    engine, manager = llm.engine, llm.engine.block_manager
    prompt_len = len(engine.tokenizer.encode(LONG_PROMPT))
    shared = (prompt_len - 1) // BLOCK_SIZE
    assert shared == 2
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=8)

    engine.add_request("fork", LONG_PROMPT, params)
    engine.step()  # sample 0 computes the prompt, samples its first token and forks 1 and 2
    seqs = engine.requests["fork"].seqs
    prefix = seqs[0].block_table[:shared]
    assert [seq.block_table for seq in seqs[1:]] == [prefix, prefix]
    assert [manager.ref_counts[b] for b in prefix] == [3, 3]
    assert [seq.num_computed_tokens for seq in seqs[1:]] == [shared * BLOCK_SIZE] * 2
    engine.step()  # 1 and 2 compute their prompt tails in their own blocks
    tables = [seq.block_table for seq in seqs]
    assert all(table[:shared] == prefix for table in tables)
    private = [b for table in tables for b in table[shared:]]
    assert len(private) == len(set(private)) and not set(private) & set(prefix)
    forked_usage = used_blocks(llm)
    assert forked_usage == shared + len(private)
    drain(engine)

    for i in range(3):  # the same prompt as three independent requests
        engine.add_request(f"solo-{i}", LONG_PROMPT, SamplingParams(temperature=0.8, seed=i, max_tokens=8))
    engine.step()
    engine.step()
    assert used_blocks(llm) == forked_usage + 2 * shared  # each holds its own copy of the prompt's blocks
    drain(engine)
    assert all_blocks_free(llm)


def test_llm_seeded_request_same_tokens_alone_and_in_batch(llm):
    seeded = SamplingParams(temperature=0.8, seed=42, max_tokens=16)
    alone = llm.generate(PROMPTS[1], seeded)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=0.8, max_tokens=16)
    batch = llm.generate([PROMPTS[0], PROMPTS[1], LONG_PROMPT], [unseeded, seeded, unseeded])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate(PROMPTS[1], SamplingParams(temperature=0.8, seed=43, max_tokens=16))[0]
    assert other_seed.outputs[0].token_ids != alone  # the seed, not the prompt, fixes the tokens


# ----------------------------------------------------------------------------------------------------------
# Validation: ValueError naming the problem, nothing left queued


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("", "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [5] * 600}, "max_model_len"),
        ({"prompt_token_ids": [5] * 512}, "max_model_len"),  # no room left for a generated token
        ({"prompt_token_ids": [-1]}, "prompt_token_ids"),
        ({"prompt_token_ids": [49152]}, "prompt_token_ids"),  # == vocab size
        ({"prompt_token_ids": [1, "a"]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1.0]}, "prompt_token_ids"),
        ({"prompt_token_ids": [True]}, "prompt_token_ids"),
        ({"prompt_token_ids": 5}, "prompt_token_ids"),
        ({"prompt_token_ids": None}, "prompt_token_ids"),
        (123, "prompt"),
        ({"prompt": "no ids"}, "prompt_token_ids"),
        ("a lone surrogate \ud800", "not valid Unicode"),  # what a JSON escape can carry
    ],
)
def test_llm_generate_bad_prompt_raises_valueerror_and_queues_nothing(llm, prompt, match):
    assert llm.engine.hf_config.vocab_size == 49152
    with pytest.raises(ValueError, match=match):
        llm.generate(["A good prompt first", prompt], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request("bad", prompt)
    assert "bad" not in llm.engine.requests


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    """vLLM's truncate_prompt_tokens: the last k tokens, as if they were the prompt; -1: as many as the context takes
    with room for one generated token (a prompt that would not fit then runs)."""
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    params = dict(temperature=0, max_tokens=4)
    truncated = llm.generate(PROMPTS[2], SamplingParams(truncate_prompt_tokens=5, **params))[0]
    tail = llm.generate({"prompt_token_ids": ids[-5:]}, SamplingParams(**params))[0]
    assert truncated.prompt_token_ids == ids[-5:] and truncated.prompt == PROMPTS[2]
    assert truncated.outputs[0].token_ids == tail.outputs[0].token_ids
    long = {"prompt_token_ids": [5] * 600}
    out = llm.generate(long, SamplingParams(truncate_prompt_tokens=-1, max_tokens=2))[0]
    assert len(out.prompt_token_ids) == llm.engine.max_model_len - 1 and len(out.outputs[0].token_ids) == 1


def test_logprobs_beyond_max_logprobs_are_refused(llm, tiny_llama_dir):
    """As vLLM: a request may ask for at most max_logprobs top tokens (20 unless the engine is told otherwise)."""
    assert llm.engine.config.max_logprobs == 20
    with pytest.raises(ValueError, match=r"logprobs asks for 21 top tokens, more than this engine's max_logprobs=20"):
        llm.generate(["A good prompt first", "another"], [SamplingParams(max_tokens=2),
                                                          SamplingParams(max_tokens=2, logprobs=21)])
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2, logprobs=20))[0].outputs[0]
    assert [len(position) for position in out.logprobs] == [20, 20]  # the greedy token is among the top 20
    # -1 asks for the whole vocabulary (vLLM's), which max_logprobs must allow.
    with pytest.raises(ValueError, match=r"prompt_logprobs asks for 49152 top tokens, .* max_logprobs=20"):
        llm.generate("Hello", SamplingParams(max_tokens=1, prompt_logprobs=-1))
    with LLM(str(tiny_llama_dir), dtype="float32", max_logprobs=-1) as whole_vocabulary:
        for logprobs in (49152, -1):
            out = whole_vocabulary.generate("Hi", SamplingParams(temperature=0, max_tokens=1, logprobs=logprobs,
                                                                 prompt_logprobs=-1 if logprobs == -1 else None))
            for position in [out[0].outputs[0].logprobs[0], *(out[0].prompt_logprobs or [None])[1:]]:
                ranks = sorted(logprob.rank for logprob in position.values())
                assert len(ranks) == 49152 and ranks[0] == 1 and ranks[-1] <= 49152


def test_llm_generate_params_count_mismatch_raises_valueerror(llm):
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_engine_duplicate_request_id_raises_valueerror(llm):
    llm.engine.add_request("dup", "Hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request("dup", "Hello again", SamplingParams(max_tokens=2))
    assert list(llm.engine.requests) == ["dup"]
    out = drain(llm.engine)["dup"]
    assert out.prompt_token_ids == llm.tokenizer.encode("Hello")


def test_llm_takes_a_tokenizer_of_its_own(tiny_llama_dir, tmp_path, llm):
    """vLLM's `tokenizer` option: the weights from one place, the tokenizer (and its chat template) from another."""
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir / name, tmp_path / name)
    with pytest.raises(ValueError, match="its tokenizer could not be loaded"):
        LLM(str(tmp_path), dtype="float32")
    with LLM(str(tmp_path), dtype="float32", tokenizer=str(tiny_llama_dir), num_kv_blocks=16) as own:
        assert greedy(own, PROMPTS[1], max_tokens=4).text == greedy(llm, PROMPTS[1], max_tokens=4).text


def test_llm_unknown_engine_option_raises_valueerror(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"unknown engine option.*not_an_option"):
        LLM(str(tiny_llama_dir), dtype="float32", not_an_option=1)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"block_size": 3}, "block_size"),
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": True}, "max_num_seqs"),
        ({"max_num_seqs": 2.0}, "max_num_seqs"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
        ({"dtype": "float8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"scheduler": "fifo"}, "scheduler"),
        ({"enforce_eager": 1}, "enforce_eager"),
        ({"max_logprobs": -2}, "max_logprobs"),
        ({"tokenizer": ""}, "tokenizer"),
        ({"revision": 3}, "revision"),
        ({"revision": "v1"}, "revision='v1' picks a version of a Hub model"),  # the model is a local directory
        # Checked against the model once its config is read.
        ({"max_model_len": 100_000}, "max_model_len"),
        ({"max_num_batched_tokens": 100, "enable_chunked_prefill": False}, "max_num_batched_tokens"),
        ({"num_kv_blocks": 4}, "KV cache"),  # fewer than one 512-token sequence needs
    ],
)
def test_llm_invalid_engine_config_raises_valueerror(tiny_llama_dir, options, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_llama_dir), **{"dtype": "float32", **options})


# ----------------------------------------------------------------------------------------------------------
# Abort


def test_engine_abort_running_request_frees_its_blocks(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("keep-1", PROMPTS[1], params)
    engine.add_request("gone", LONG_PROMPT, SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=20))
    engine.add_request("keep-2", PROMPTS[2], params)
    for _ in range(3):
        engine.step()
    gone = engine.requests["gone"]
    assert all(seq.block_table for seq in gone.seqs)  # forked and running, sharing prompt blocks

    out = engine.abort_request("gone")

    assert out.finished and out.request_id == "gone"
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert all(0 < len(c.token_ids) < 20 for c in out.outputs)
    assert all(seq.block_table == [] for seq in gone.seqs)
    assert engine.abort_request("gone") is None  # unknown by now
    finished = drain(engine)
    assert set(finished) == {"keep-1", "keep-2"}
    assert all(out.outputs[0].finish_reason == "length" for out in finished.values())
    assert all_blocks_free(llm)


def test_interrupted_generate_leaves_nothing_queued(llm, monkeypatch):
    """Ctrl-C in the middle of `generate`: its requests are aborted, not run by the next call (which would wait for
    them and throw their outputs away)."""
    step, steps = llm.engine.step, 0

    def interrupted_step():
        nonlocal steps
        steps += 1
        if steps == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert not llm.engine.has_unfinished_requests()
    assert all_blocks_free(llm)


def test_engine_abort_waiting_request_before_any_step(llm):
    engine = llm.engine
    engine.add_request("never-run", PROMPTS[1], SamplingParams(n=2, max_tokens=4))
    out = engine.abort_request("never-run")
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert all(c.token_ids == [] for c in out.outputs)
    assert not engine.has_unfinished_requests() and engine.step() == []


# ----------------------------------------------------------------------------------------------------------
# Finish reasons


@pytest.fixture(scope="module")
def greedy_ref(llm):
    """A greedy continuation of PROMPTS[1] to derive stop conditions from."""
    out = greedy(llm, PROMPTS[1], max_tokens=24)
    assert out.finish_reason == "length" and len(out.token_ids) == 24
    return out


def prefix_text(llm: LLM, num_tokens: int) -> str:
    return greedy(llm, PROMPTS[1], max_tokens=num_tokens).text


def test_llm_max_tokens_finishes_with_length(llm, greedy_ref):
    out = greedy(llm, PROMPTS[1], max_tokens=5)
    assert out.token_ids == greedy_ref.token_ids[:5]
    assert (out.finish_reason, out.stop_reason) == ("length", None)


@pytest.mark.parametrize("stop_by", ["stop_token_ids", "eos"])
def test_llm_stop_token_finishes_with_stop_and_its_text_only_when_asked(llm, greedy_ref, monkeypatch, stop_by):
    """A token of stop_token_ids, or the tokenizer's EOS (vLLM's stop reason None), ends the output with
    finish_reason "stop"; it is in token_ids, and its text in the text only with include_stop_str_in_output."""
    at = next(i for i in range(4, 24) if greedy_ref.token_ids[i] not in greedy_ref.token_ids[:i])
    stop_id = greedy_ref.token_ids[at]
    if stop_by == "eos":
        monkeypatch.setattr(llm.engine, "eos_token_id", stop_id)
        monkeypatch.setattr(llm.engine, "eos_token_ids", {stop_id})
        stop = {}
    else:
        stop = {"stop_token_ids": [stop_id], "ignore_eos": True}

    def run(**params):
        return llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, **stop, **params))[0].outputs[0]

    out = run()
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id if stop_by == "stop_token_ids" else None)
    assert out.token_ids == greedy_ref.token_ids[: at + 1]  # the stop token is in token_ids ...
    assert out.text == prefix_text(llm, at)  # ... but, as in vLLM, not in the text
    assert run(include_stop_str_in_output=True).text == prefix_text(llm, at + 1)


def test_generation_config_eos_ids_end_the_output(tiny_llama_dir, tmp_path, greedy_ref):
    """An EOS id named only in generation_config.json (as Llama 3's <|eot_id|> is) ends the output, as transformers'
    generate and vLLM stop on it (vLLM's stop reason: its id, as for stop_token_ids); ignore_eos ignores it too."""
    at = next(i for i in range(4, 24) if greedy_ref.token_ids[i] not in greedy_ref.token_ids[:i])
    directory = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, directory)
    generation_config = json.loads((directory / "generation_config.json").read_text())
    generation_config["eos_token_id"] = [generation_config["eos_token_id"], greedy_ref.token_ids[at]]
    (directory / "generation_config.json").write_text(json.dumps(generation_config))
    params = SamplingParams(temperature=0, max_tokens=24)
    with LLM(str(directory), dtype="float32", num_kv_blocks=128) as llm:
        out = llm.generate(PROMPTS[1], params)[0].outputs[0]
        ignored = llm.generate(PROMPTS[1], replace(params, ignore_eos=True))[0].outputs[0]
    eos = greedy_ref.token_ids[at]
    assert out.token_ids == greedy_ref.token_ids[: at + 1] and (out.finish_reason, out.stop_reason) == ("stop", eos)
    assert ignored.token_ids == greedy_ref.token_ids


def test_generation_config_sampling_is_the_default_of_requests_without_params(tiny_llama_dir, tmp_path,
                                                                              monkeypatch):
    """As vLLM's `--generation-config auto` (its default): a request without SamplingParams samples as the
    checkpoint's generation_config.json recommends; `generation_config="vllm"` keeps SamplingParams' own defaults."""
    directory = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, directory)
    generation_config = json.loads((directory / "generation_config.json").read_text())
    generation_config.update(do_sample=True, temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=5)
    (directory / "generation_config.json").write_text(json.dumps(generation_config))
    with LLM(str(directory), dtype="float32", num_kv_blocks=128) as llm:
        defaults = llm.get_default_sampling_params()
        assert defaults == SamplingParams(temperature=0.6, top_p=0.9, top_k=20, max_tokens=5)
        added = []
        add_request = llm.engine.add_request
        monkeypatch.setattr(llm.engine, "add_request", lambda request_id, prompt, params, **more: (
            added.append(params), add_request(request_id, prompt, params, **more))[1])
        out = llm.generate(PROMPTS[0])[0].outputs[0]
        chat = llm.chat([{"role": "user", "content": "Hi"}])[0].outputs[0]
    assert [replace(params, output_kind=defaults.output_kind) for params in added] == [defaults, defaults]
    assert len(out.token_ids) <= 5 and len(chat.token_ids) <= 5
    with LLM(str(directory), dtype="float32", num_kv_blocks=128, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_llm_stop_string_finishes_with_stop_and_the_string(llm, greedy_ref):
    start = len(prefix_text(llm, 6))
    stop = greedy_ref.text[start : start + 3]
    assert greedy_ref.text.find(stop) == start and stop.strip()
    out = greedy(llm, PROMPTS[1], max_tokens=24, stop=[stop])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == greedy_ref.text[:start]
    assert 6 < len(out.token_ids) < 24 and out.token_ids == greedy_ref.token_ids[: len(out.token_ids)]
    included = greedy(llm, PROMPTS[1], max_tokens=24, stop=[stop], include_stop_str_in_output=True)
    assert included.text == greedy_ref.text[: start + 3]


def test_llm_min_tokens_defers_stop_string(llm, greedy_ref):
    early = prefix_text(llm, 3)
    stop = early[-2:]  # the stop string is complete after 3 tokens
    assert greedy(llm, PROMPTS[1], max_tokens=24, stop=[stop]).token_ids == greedy_ref.token_ids[:3]
    out = greedy(llm, PROMPTS[1], max_tokens=24, stop=[stop], min_tokens=10)
    # As in vLLM, stop strings are only looked for after min_tokens tokens: the first match past them ends it.
    assert len(out.token_ids) > 10
    assert out.token_ids == greedy_ref.token_ids[: len(out.token_ids)]
    later = greedy_ref.text.find(stop, len(prefix_text(llm, 10)) - len(stop) + 1)
    if later == -1:
        assert (out.finish_reason, out.text) == ("length", greedy_ref.text)
    else:
        assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, greedy_ref.text[:later])


def test_llm_min_tokens_blocks_stop_token_id(llm, greedy_ref):
    stop_id = greedy_ref.token_ids[2]
    out = greedy(llm, PROMPTS[1], max_tokens=24, stop_token_ids=[stop_id], min_tokens=8)
    assert stop_id not in out.token_ids[:8]
    assert out.token_ids[:2] == greedy_ref.token_ids[:2]
    assert len(out.token_ids) > 8
    assert out.finish_reason == "length" or (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_llm_logit_bias_and_allowed_token_ids_steer_every_token(llm, greedy_ref):
    forced = next(t for t in greedy_ref.token_ids if t != greedy_ref.token_ids[0])
    out = greedy(llm, PROMPTS[1], max_tokens=6, logit_bias={forced: 100.0})
    assert out.token_ids == [forced] * 6
    allowed = greedy_ref.token_ids[6:9]
    out = greedy(llm, PROMPTS[1], max_tokens=12, allowed_token_ids=allowed)
    assert set(out.token_ids) <= set(allowed)
    sampled = llm.generate(PROMPTS[1], SamplingParams(max_tokens=12, seed=3, allowed_token_ids=allowed))
    assert set(sampled[0].outputs[0].token_ids) <= set(allowed)
    # The logprobs stay the model's own (vLLM's raw logprobs): the biased token keeps its rank, the top token its value.
    biased = greedy(llm, PROMPTS[1], max_tokens=1, logprobs=1, logit_bias={forced: 100.0}).logprobs[0]
    plain = greedy(llm, PROMPTS[1], max_tokens=1, logprobs=0).logprobs[0]
    top = greedy_ref.token_ids[0]
    assert biased[top].logprob == plain[top].logprob and biased[top].rank == 1
    assert biased[forced].rank > 1 and biased[forced].logprob < plain[top].logprob


def test_bad_words_are_tokenized_at_the_start_of_text_and_after_a_space(llm):
    tokenizer = llm.get_tokenizer()
    forms = [tokenizer.encode("Paris", add_special_tokens=False), tokenizer.encode(" Paris", add_special_tokens=False)]
    assert forms[0] != forms[1]
    assert bad_words_token_ids(tokenizer, ["Paris", "  Paris"]) == forms


def test_llm_bad_words_are_never_generated(llm, greedy_ref):
    first = greedy_ref.token_ids[0]
    word = llm.get_tokenizer().decode([first])
    assert [first] in bad_words_token_ids(llm.get_tokenizer(), [word])
    for params in (dict(temperature=0), dict(seed=5)):
        out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, bad_words=[word], **params))[0].outputs[0]
        assert first not in out.token_ids


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog"]}}}


def is_person(text: str) -> bool:
    person = json.loads(text)
    return set(person) == {"name", "age", "pet"} and person["pet"] in ("cat", "dog") and isinstance(person["age"], int)


CHOICES = ["yes", "no", 'a "quoted" maybe']
FORMATS = {
    # The random model would write whitespace without end where JSON allows it.
    "json": (StructuredOutputsParams(json=PERSON, disable_any_whitespace=True), is_person),
    "json_object": (StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
                    lambda text: isinstance(json.loads(text), dict)),
    "regex": (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
              lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda text: text in CHOICES),
    "grammar": (StructuredOutputsParams(grammar='start: item item "!"\nitem: "ab" | "c"'),
                lambda text: re.fullmatch(r"(ab|c){2}!", text)),
    "gbnf": (StructuredOutputsParams(grammar='root ::= item item "?"\nitem ::= "ab" | "c"'),  # llama.cpp's, vLLM's
             lambda text: re.fullmatch(r"(ab|c){2}\?", text)),
}


def format_accepts(llm, spec: StructuredOutputsParams, token_ids: list[int]) -> bool:
    """Whether a fresh matcher of the format takes every token in turn: the output keeps to it so far."""
    matcher = llm.engine.grammars.matcher(spec)
    return all(matcher.consume_token(token) and not matcher.is_error() for token in token_ids)


@pytest.mark.parametrize("name", list(FORMATS))
def test_structured_outputs_keep_to_their_format_greedy_or_sampled(llm, name):
    """The random model left alone writes nothing of the kind: every output here keeps to its format, ends with
    EOS once the format is complete (finish_reason stop), and a plain request beside it is not touched. A sampled
    JSON object's string may run past max_tokens (a random model seldom draws its closing quote): such a sample
    must have kept to the format as far as it went."""
    spec, keeps_format = FORMATS[name]
    plain = greedy(llm, PROMPTS[1], max_tokens=8)
    params = [SamplingParams(temperature=0, max_tokens=64, structured_outputs=spec),
              SamplingParams(n=2, seed=1, max_tokens=64, structured_outputs=spec),
              SamplingParams(temperature=0, max_tokens=8)]
    outputs = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], params)
    for sample in [*outputs[0].outputs, *outputs[1].outputs]:
        assert format_accepts(llm, spec, sample.token_ids), sample.text
        if name == "json_object" and sample.finish_reason == "length":
            continue
        assert keeps_format(sample.text), sample.text
        assert (sample.finish_reason, sample.token_ids[-1]) == ("stop", llm.engine.eos_token_id)
    assert outputs[0].outputs[0].finish_reason == "stop"  # the greedy sample completes every format
    assert outputs[2].outputs[0].token_ids == plain.token_ids
    alone = llm.generate(PROMPTS[0], params[0])[0].outputs[0]
    assert alone.token_ids == outputs[0].outputs[0].token_ids


def test_structured_outputs_logprobs_are_the_formats_distribution(llm):
    """As vLLM's (its format masks the logits before its sampler): a token the format forces has logprob 0 and rank
    1, and the top tokens are the format's, their probabilities summing to 1 where the format allows fewer than k."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=20, structured_outputs=FORMATS["choice"][0])
    sample = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert sample.token_ids[-1] == llm.engine.eos_token_id
    end = sample.logprobs[-1][llm.engine.eos_token_id]
    assert (end.logprob, end.rank) == (0.0, 1)
    for token, position in zip(sample.token_ids, sample.logprobs, strict=True):
        allowed = [lp.logprob for lp in position.values() if lp.logprob > -math.inf]
        assert position[token].rank == 1 and len(allowed) < 20
        assert sum(map(math.exp, allowed)) == pytest.approx(1.0, rel=1e-5)


def test_structured_outputs_keep_their_tokens_under_preemption_and_chunked_prefill(tiny_llama_dir, llm):
    """A preempted sequence's matcher keeps its place (its tokens stay; only their K/V is recomputed)."""
    spec, keeps_format = FORMATS["json"]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)
    expected = [out.outputs[0].token_ids for out in llm.generate(SHORT_PROMPTS, params)]
    # 6 blocks of 16 tokens for eight sequences of ~30 tokens.
    with LLM(str(tiny_llama_dir), dtype="float32", block_size=BLOCK_SIZE, max_model_len=64, num_kv_blocks=6,
             max_num_batched_tokens=BLOCK_SIZE, long_prefill_token_threshold=BLOCK_SIZE // 2) as tight:
        outputs = tight.generate(SHORT_PROMPTS, params)
        assert sum(out.metrics.num_preemptions for out in outputs) > 0
    assert [out.outputs[0].token_ids for out in outputs] == expected
    assert all(keeps_format(out.outputs[0].text) for out in outputs if out.outputs[0].finish_reason == "stop")


def test_a_request_left_no_token_to_sample_fails_alone(llm, greedy_ref):
    """allowed_token_ids whose every token a bad word bans (or a format excludes): that request ends with an error
    saying so, the others in its batch unharmed."""
    token = greedy_ref.token_ids[0]
    engine = llm.engine
    engine.add_request("stuck", PROMPTS[1], SamplingParams(allowed_token_ids=[token], max_tokens=4,
                                                            bad_words=[llm.get_tokenizer().decode([token])]))
    engine.add_request("free", PROMPTS[1], SamplingParams(temperature=0, max_tokens=4))
    finished = drain(engine)
    assert finished["stuck"].outputs[0].finish_reason == "abort"
    assert "no token is left to sample" in finished["stuck"].error
    assert finished["free"].error is None and finished["free"].outputs[0].token_ids == greedy_ref.token_ids[:4]
    assert all_blocks_free(llm)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (StructuredOutputsParams(regex="[a-"), "regex"),
        (StructuredOutputsParams(json={"type": "nonsense"}), "nonsense"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "undefined_rule"),
    ],
)
def test_a_format_that_does_not_compile_is_refused_before_anything_is_queued(llm, spec, match):
    with pytest.raises(ValueError, match=rf"structured_outputs: the format does not compile: .*{match}"):
        llm.generate(["A good prompt first", "another"],
                     [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, structured_outputs=spec)])
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (dict(logit_bias={49152: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[5, -1]), "allowed_token_ids"),
        (dict(allowed_token_ids=[2], min_tokens=2), "allowed_token_ids"),  # only EOS allowed, and EOS blocked
        (dict(allowed_token_ids=[2, 7], stop_token_ids=[7], min_tokens=1), "allowed_token_ids"),
    ],
)
def test_logit_edits_out_of_the_vocabulary_are_refused(llm, params, match):
    assert llm.engine.eos_token_ids == {2}
    with pytest.raises(ValueError, match=match):
        llm.generate(["A good prompt first", "another"], [SamplingParams(max_tokens=2), SamplingParams(**params)])
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def eos_llm(tiny_llama_dir, tmp_path_factory, greedy_ref):
    """The same weights, but the config names the 4th greedy token of PROMPTS[1] as a second EOS id."""
    eos_id = greedy_ref.token_ids[3]
    assert eos_id not in greedy_ref.token_ids[:3]
    directory = tmp_path_factory.mktemp("tiny-llama-eos")
    shutil.copytree(tiny_llama_dir, directory, dirs_exist_ok=True)
    config = json.loads((directory / "config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], eos_id]
    (directory / "config.json").write_text(json.dumps(config))
    return LLM(str(directory), dtype="float32", num_kv_blocks=64), eos_id


def eos_generate(eos: LLM, **params):
    return eos.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, **params))[0].outputs[0]


def test_llm_eos_of_the_config_finishes_with_stop_and_its_id(llm, eos_llm, greedy_ref):
    """An EOS id the config adds to the tokenizer's ends the output as vLLM reports it: stop reason the id (the
    tokenizer's own EOS: None, test_llm_stop_token_finishes_with_stop_and_its_text_only_when_asked)."""
    eos, eos_id = eos_llm
    out = eos_generate(eos)
    assert (out.finish_reason, out.stop_reason) == ("stop", eos_id)
    assert out.token_ids == greedy_ref.token_ids[:4] and out.token_ids[-1] == eos_id
    assert out.text == prefix_text(llm, 3)  # EOS is not detokenized


def test_llm_ignore_eos_runs_to_max_tokens(eos_llm, greedy_ref):
    eos, _ = eos_llm
    out = eos_generate(eos, ignore_eos=True)
    assert out.token_ids == greedy_ref.token_ids
    assert (out.finish_reason, out.stop_reason) == ("length", None)


def test_llm_min_tokens_blocks_eos(eos_llm, greedy_ref):
    eos, eos_id = eos_llm
    out = eos_generate(eos, min_tokens=6)
    assert eos_id not in out.token_ids[:6] and len(out.token_ids) > 6
    assert out.token_ids[:3] == greedy_ref.token_ids[:3]
    assert all_blocks_free(eos)


# ----------------------------------------------------------------------------------------------------------
# Chat


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "What colour is the sky?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And grass?"},
    ],
]


def chat_template_ids(tokenizer, conversation) -> list[int]:
    encoded = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])


def test_llm_chat_one_conversation_uses_chat_template(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.chat(CONVERSATIONS[0], params)
    assert len(outs) == 1
    expected = chat_template_ids(llm.tokenizer, CONVERSATIONS[0])
    assert outs[0].prompt_token_ids == expected
    assert llm.tokenizer.decode(expected).endswith("<|im_start|>assistant\n")  # the generation prompt
    assert outs[0].outputs[0].token_ids == greedy(llm, {"prompt_token_ids": expected}, max_tokens=6).token_ids


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("Hello", "messages is a conversation"),
        ([{"content": "Hello"}], "message 0 must be a dict with a string 'role'"),
        ([["user", "Hello"]], "message 0 must be a dict"),
        ([{"role": "user", "content": 5}], "message 0's content must be a string or a list of text parts"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "list of text parts"),
    ],
)
def test_llm_chat_malformed_conversation_raises_valueerror(llm, messages, match):
    with pytest.raises(ValueError, match=match):  # not the template's jinja2 UndefinedError or TypeError
        llm.chat(messages, SamplingParams(max_tokens=2))


def test_llm_chat_content_as_text_parts_or_none_renders_as_a_string(llm):
    """Text parts are joined by newlines, as vLLM joins them for templates that read a string."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "First."}, {"type": "text", "text": "Second."}]}]
    assert llm.apply_chat_template(parts) == llm.apply_chat_template([{"role": "user",
                                                                       "content": "First.\nSecond."}])
    assert llm.apply_chat_template([{"role": "user", "content": None}]) == llm.apply_chat_template(
        [{"role": "user", "content": ""}])


def test_llm_chat_list_of_conversations_one_output_each_in_order(llm):
    outs = llm.chat(CONVERSATIONS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(outs) == len(CONVERSATIONS)
    for out, conversation in zip(outs, CONVERSATIONS, strict=True):
        assert out.prompt_token_ids == chat_template_ids(llm.tokenizer, conversation)
        # As vLLM's: the prompt is the rendered template's text.
        assert out.prompt == llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                               tokenize=False)
        assert out.finished and len(out.outputs[0].token_ids) == 4
