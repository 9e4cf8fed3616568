"""Random engine configurations and requests against the plain engine (hypothesis).

Whatever the pool size, the scheduler, prefix caching, chunking and speculative decoding, with samples of n > 1
requests forked off their first one, stop strings and an abort mixed in: every request ends, every block comes back,
and each sample of a greedy or seeded request has the plain engine's tokens and text, with plain K/V pools and with
int8 ones, and where our kernels compute every row (heads of 64) its log-probabilities to the bit. (Such runs found
the engine looping for ever on a tight pool with n > 1 requests, and a preempted sequence going on from other K/V than
it had, 2026-12-05.)
"""

import pytest
from conftest import sampled_logprobs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from liteinfer import LLM, SamplingParams, kernels

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MAX_MODEL_LEN = 128  # the smallest pool below, 8 blocks of 16 tokens, holds one sequence at full length
MAX_STEPS = 5_000

# Speculative decoding by prompt lookup, or none.
speculative_configs = st.none() | st.fixed_dictionaries({
    "num_speculative_tokens": st.integers(1, 5), "prompt_lookup_min": st.just(1),
    "prompt_lookup_max": st.integers(1, 4),
})
engine_configs = st.one_of(
    st.fixed_dictionaries({
        "scheduler": st.just("continuous"),
        "speculative_config": speculative_configs,
        "block_size": st.sampled_from([16, 32]),
        "num_kv_blocks": st.sampled_from([8, 12, 24, 64]),
        "max_num_seqs": st.sampled_from([1, 2, 4, 32]),
        "enable_prefix_caching": st.booleans(),
        "enable_chunked_prefill": st.booleans(),
        "max_num_batched_tokens": st.sampled_from([16, 48, 256]),
    }).map(lambda c: c if c["enable_chunked_prefill"] else {**c, "max_num_batched_tokens": MAX_MODEL_LEN}),
    st.fixed_dictionaries({
        "scheduler": st.just("static"),
        "speculative_config": speculative_configs,
        "block_size": st.sampled_from([16, 32]),
        "num_kv_blocks": st.sampled_from([8, 24]),
        "max_num_seqs": st.sampled_from([1, 3]),
    }),
)
# (prompt length, shares the common prefix, max_tokens, n, seeded sampling rather than greedy, stop strings, kept to
# a few tokens: a random model's text then repeats itself, so that speculative decoding keeps drafts)
request_specs = st.lists(
    st.tuples(st.integers(1, 80), st.booleans(), st.integers(1, 40), st.integers(1, 3), st.booleans(),
              st.sampled_from([[], ["e"], [" the", "ab"]]), st.booleans()),
    min_size=1, max_size=8,
)


@pytest.fixture(scope="module", params=["heads of 16", "heads of 64", "heads of 64, int8 pools"])
def model(request, tiny_llama_dir, tiny_heads_64) -> tuple[str, dict, bool]:
    """(directory, engine options, whether log-probabilities must be equal to the bit). The tiny Llama's heads of 16
    take PyTorch's SDPA for prompts, whose path for a chunk after cached keys rounds otherwise than a whole prompt's:
    tokens only. Heads of 64 take our kernels where the CPU has AVX-512 (int8 pools: VNNI, their decode kernel
    rounding the query to 8 bits, so that a token on the other path shows), and each token takes the path of what it
    is whatever the step's shape: the same bits."""
    kernels.load()
    if request.param == "heads of 16":
        return str(tiny_llama_dir), {}, False
    if request.param == "heads of 64":
        return str(tiny_heads_64), {}, kernels.prefill_available()
    int8_kernels = kernels.prefill_available() and kernels.int8_pools_available()
    return str(tiny_heads_64), {"kv_cache_dtype": "int8"}, int8_kernels


@pytest.fixture(scope="module")
def plain(model) -> LLM:
    """Every request at once in a pool for all of them: nothing preempted, chunked or cached."""
    directory, options, _ = model
    return LLM(directory, dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=512,
               max_num_batched_tokens=4096, enable_chunked_prefill=False, enable_prefix_caching=False, **options)


def run(llm: LLM, requests: dict, abort: tuple[str, int] | None = None) -> dict:
    """The finished outputs by request id, stepping the engine by hand so that one request can be aborted at a
    given step."""
    engine = llm.engine
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs = {}
    for step in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        outputs.update((out.request_id, out) for out in engine.step() if out.finished)
        if abort is not None and step == abort[1] and (out := engine.abort_request(abort[0])) is not None:
            outputs[abort[0]] = out
    assert not engine.has_unfinished_requests(), f"still unfinished after {MAX_STEPS} steps: the engine is stuck"
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks and not any(manager.ref_counts)
    return outputs


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=engine_configs, specs=request_specs, prefix=st.lists(st.integers(10, 5000), min_size=20, max_size=20),
       tokens=st.randoms(use_true_random=False), abort_at=st.none() | st.tuples(st.integers(0, 7), st.integers(0, 20)))
def test_random_engine_config_and_requests_give_the_plain_engines_samples(
    model, plain, config, specs, prefix, tokens, abort_at
):
    directory, options, bitwise = model
    llm = LLM(directory, dtype="float32", max_model_len=MAX_MODEL_LEN, **config, **options)
    requests = {}
    for i, (length, shared, max_tokens, n, seeded, stop, few_tokens) in enumerate(specs):
        ids = (prefix if shared else []) + [tokens.randrange(10, 5000) for _ in range(length)]
        params = SamplingParams(max_tokens=max_tokens, n=n, stop=stop, ignore_eos=True, logprobs=0,
                                allowed_token_ids=list(range(300, 305)) if few_tokens else None,
                                **({"temperature": 0.8, "top_p": 0.9, "seed": i} if seeded else {"temperature": 0}))
        requests[f"r{i}"] = ({"prompt_token_ids": ids}, params)
    abort = None if abort_at is None or abort_at[0] >= len(specs) else (f"r{abort_at[0]}", abort_at[1])

    outputs = run(llm, requests, abort)
    expected = run(plain, {request_id: request for request_id, request in requests.items()
                           if abort is None or request_id != abort[0]})

    assert set(outputs) == set(requests)
    for request_id, want in expected.items():
        got = outputs[request_id]
        assert [(s.token_ids, s.text, s.finish_reason) for s in got.outputs] == [
            (s.token_ids, s.text, s.finish_reason) for s in want.outputs], request_id
        if bitwise:
            assert list(map(sampled_logprobs, got.outputs)) == list(map(sampled_logprobs, want.outputs)), request_id
