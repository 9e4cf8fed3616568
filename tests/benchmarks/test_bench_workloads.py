"""Workloads are reproducible from their parameters, and their hash tells two apart."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest

# benchmarks/ sits at the repository root and is not installed with liteinfer: `python -m pytest` finds it through
# the working directory, `pytest` alone does not. (A conftest.py here would shadow tests/conftest.py's helpers.)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
pytest.importorskip("psutil", reason="the harness needs the bench extra: pip install -e '.[bench]'")
pytest.importorskip("matplotlib", reason="the harness needs the bench extra: pip install -e '.[bench]'")

from benchmarks.workloads import (  # noqa: E402
    WORKLOAD_NAMES,
    Sampling,
    WorkloadParams,
    make_workload,
    warmup_workload,
)

TOKENS = list(range(17, 1000))  # stands for a vocabulary without its special tokens
PARAMS = WorkloadParams(num_prompts=8, prompt_min=5, prompt_max=9, output_len=12, prefix_len=20, latency_prompts=3)


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_same_parameters_same_workload_and_hash(name):
    a, b = make_workload(name, PARAMS, TOKENS), make_workload(name, PARAMS, TOKENS)
    assert a == b and a.hash == b.hash
    assert all(t in TOKENS for r in a.requests for t in r.prompt_token_ids)


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_another_seed_is_another_workload(name):
    assert make_workload(name, PARAMS, TOKENS).hash != make_workload(name, replace(PARAMS, seed=1), TOKENS).hash


def test_hash_changes_with_any_request_detail():
    workload = make_workload("throughput", PARAMS, TOKENS)
    longer = replace(workload, requests=[replace(workload.requests[0], output_len=13), *workload.requests[1:]])
    assert longer.hash != workload.hash


def test_throughput_lengths_and_latency_takes_its_first_prompts():
    throughput = make_workload("throughput", PARAMS, TOKENS)
    latency = make_workload("latency", PARAMS, TOKENS)
    assert len(throughput.requests) == 8 and not throughput.one_at_a_time
    assert all(5 <= len(r.prompt_token_ids) <= 9 and r.output_len == 12 for r in throughput.requests)
    assert latency.one_at_a_time and latency.requests == throughput.requests[:3]
    # Distinct prompts: no prefix cache could make one request cheaper because of another.
    assert len({tuple(r.prompt_token_ids[:4]) for r in throughput.requests}) == 8


def test_prefix_workload_shares_exactly_its_prefix():
    requests = make_workload("prefix", PARAMS, TOKENS).requests
    shared = requests[0].prompt_token_ids[:20]
    assert all(r.prompt_token_ids[:20] == shared and 25 <= len(r.prompt_token_ids) <= 29 for r in requests)


def test_mixed_workload_draws_prompt_and_output_lengths_from_their_ranges():
    requests = make_workload("mixed", replace(PARAMS, num_prompts=200), TOKENS).requests
    prompt_lens = {len(r.prompt_token_ids) for r in requests}
    output_lens = {r.output_len for r in requests}
    assert min(prompt_lens) >= 5 and max(prompt_lens) <= 36 and len(prompt_lens) > 10
    assert min(output_lens) >= 2 and max(output_lens) <= 24 and len(output_lens) > 10


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_warmup_has_the_same_kind_of_work_with_other_prompts(name):
    workload = make_workload(name, PARAMS, TOKENS)
    warmup = warmup_workload(name, PARAMS, TOKENS, max_output_len=4)
    assert len(warmup.requests) == len(workload.requests) and warmup.one_at_a_time == workload.one_at_a_time
    assert all(r.output_len <= 4 for r in warmup.requests)
    assert not {tuple(r.prompt_token_ids) for r in warmup.requests} & {tuple(r.prompt_token_ids)
                                                                      for r in workload.requests}


def test_unknown_workload_and_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("bursty", PARAMS, TOKENS)
    with pytest.raises(ValueError, match="prompt_min"):
        make_workload("throughput", replace(PARAMS, prompt_min=10, prompt_max=9), TOKENS)
    for bad, match in [(dict(output_len=0), "output_len"), (dict(num_prompts=0), "num_prompts"),
                       (dict(latency_prompts=9), "latency_prompts"), (dict(latency_prompts=0), "latency_prompts")]:
        with pytest.raises(ValueError, match=match):
            make_workload("latency", replace(PARAMS, **bad), TOKENS)


def test_greedy_workloads_keep_the_hashes_they_had_before_sampling():
    """Recorded results name workloads by hash (docs/benchmarks.md): these are PARAMS' hashes as computed before
    requests carried a sampling."""
    hashes = {name: make_workload(name, PARAMS, TOKENS).hash for name in WORKLOAD_NAMES}
    assert hashes == {"throughput": "3244199648103f65", "latency": "0a7a07dce4882430", "prefix": "f8d302509f6243b9",
                      "mixed": "aa46dfc31a37c2aa"}


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_a_sampled_workload_is_the_same_requests_sampled(name):
    sampling = Sampling(temperature=0.8, top_p=0.95, top_k=40)
    greedy = make_workload(name, PARAMS, TOKENS)
    sampled = make_workload(name, replace(PARAMS, sampling=sampling), TOKENS)
    assert [replace(r, sampling=Sampling()) for r in sampled.requests] == greedy.requests
    assert all(r.sampling == sampling for r in sampled.requests) and sampled.hash != greedy.hash
    assert sampled.describe() == greedy.describe() + ", sampled at temperature 0.8, top-k 40, top-p 0.95"
    warmup = warmup_workload(name, replace(PARAMS, sampling=sampling), TOKENS, 4)
    assert all(r.sampling == sampling for r in warmup.requests)


def test_impossible_sampling_is_refused():
    for fields in ({"temperature": -0.1}, {"temperature": 1, "top_p": 0}, {"temperature": 1, "top_p": 1.5},
                   {"temperature": 1, "top_k": -1}, {"top_p": 0.9}, {"top_k": 5}):
        with pytest.raises(ValueError):
            Sampling(**fields)
