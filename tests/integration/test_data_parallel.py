"""Data parallelism on Ray: two replicas of a tiny Llama on a local cluster give one engine's greedy outputs, and
a replica killed mid-run loses no request."""

import gc
from collections import defaultdict
from dataclasses import replace

import pytest

ray = pytest.importorskip("ray")

from liteinfer import LLM, RequestOutputKind, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster and two engine processes: ~30 s

PROMPTS = [f"Request {i}: the {word} is" for i, word in enumerate(["sky", "sea", "cat", "tree"] * 8)]  # 32
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
OPTIONS = dict(dtype="float32", num_kv_blocks=64, max_model_len=128)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    """One engine's greedy output (token ids and text) of each prompt."""
    with LLM(str(tiny_llama_dir), **OPTIONS) as llm:
        return [out.outputs[0] for out in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def replicas(cluster, tiny_llama_dir):
    with LLM(str(tiny_llama_dir), data_parallel_size=2, **OPTIONS) as llm:
        yield llm


def test_async_llm_streams_over_replicas(cluster, tiny_llama_dir, expected):
    """The server's path: AsyncLLM drives the replicas like one engine; streamed deltas add up to the text. (First
    in the file: its replicas are gone before the `replicas` fixture asks the 2-CPU cluster for two more.)"""
    import asyncio

    from liteinfer import AsyncLLM

    async def main():
        async with AsyncLLM(str(tiny_llama_dir), data_parallel_size=2, **OPTIONS) as llm:
            outputs = await llm.generate(PROMPTS[:8], GREEDY)
            streamed = "".join([event.delta async for event in llm.stream(PROMPTS[0], GREEDY)])
            llm.engine.shutdown()
            return outputs, streamed

    outputs, streamed = asyncio.run(main())
    assert [out.outputs[0].token_ids for out in outputs] == [sample.token_ids for sample in expected[:8]]
    assert streamed == expected[0].text


def test_two_replicas_serve_32_requests_with_one_engines_greedy_outputs(replicas, expected):
    outputs = replicas.generate(PROMPTS, GREEDY)
    assert [out.prompt for out in outputs] == PROMPTS  # in order
    assert [out.outputs[0].token_ids for out in outputs] == [sample.token_ids for sample in expected]
    assert all(out.error is None for out in outputs)


def test_requests_are_spread_least_loaded(replicas):
    engine = replicas.engine
    for i, prompt in enumerate(PROMPTS[:6]):
        engine.add_request(f"spread-{i}", prompt, GREEDY)
    assert [len(r.requests) for r in engine.replicas] == [3, 3]
    while engine.has_unfinished_requests():
        engine.step()


def test_each_replica_moved_its_start_up_heap_out_of_the_collectors_reach(replicas):
    """A replica's process is ours: what its start-up made is frozen, so that a full collection there does not stop
    its engine for ~0.2 s (engine/workers.py: freeze_startup_objects)."""
    counts = ray.get([r.actor.__ray_call__.remote(lambda _: gc.get_freeze_count()) for r in replicas.engine.replicas])
    assert len(counts) == 2 and min(counts) > 100_000


def test_killing_a_replica_mid_run_loses_no_request(replicas, expected):
    """Greedy requests of the dead replica are retried on the other one: every request finishes, same tokens; those
    that report DELTA outputs (half of each replica's) hand out each token and character once, not the retry's
    replay of them (their prompt logprobs in the first output alone)."""
    engine = replicas.engine
    delta = replace(GREEDY, output_kind=RequestOutputKind.DELTA, prompt_logprobs=0)

    def reports_delta(i: int) -> bool:  # the requests alternate between the two replicas
        return i % 4 >= 2

    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"kill-{i}", prompt, delta if reports_delta(i) else GREEDY)
    outputs, prompt_scores = defaultdict(list), defaultdict(list)

    def step():
        for out in engine.step():
            outputs[out.request_id].append(out.outputs[0])
            prompt_scores[out.request_id].append(out.prompt_logprobs)

    victim = engine.replicas[0]

    def victim_shows_delta() -> bool:
        return any(reports_delta(i) and outputs[f"kill-{i}"] and f"kill-{i}" in victim.requests
                   for i in range(len(PROMPTS)))

    # Both replicas under way, the victim's DELTA outputs begun: a step takes what the replicas have made by then, so
    # on a loaded machine it can take more than a few.
    for _ in range(4):
        step()
    while not victim_shows_delta() and victim.requests:
        step()
    assert victim_shows_delta(), "the victim should hold a DELTA request under way"
    ray.kill(victim.actor, no_restart=True)
    while engine.has_unfinished_requests():
        step()
    assert not victim.alive
    assert sorted(outputs) == sorted(f"kill-{i}" for i in range(len(PROMPTS)))
    for i, sample in enumerate(expected):
        mine = outputs[f"kill-{i}"]
        assert mine[-1].finish_reason == "length"
        if reports_delta(i):
            assert [t for out in mine for t in out.token_ids] == sample.token_ids
            assert "".join(out.text for out in mine) == sample.text
            first, *later = prompt_scores[f"kill-{i}"]
            assert len(first) == len(replicas.tokenizer.encode(PROMPTS[i])) and later == [None] * len(later)
        else:
            assert mine[-1].token_ids == sample.token_ids and mine[-1].text == sample.text
