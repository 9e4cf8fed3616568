"""Data parallelism on Ray: two replicas of a tiny Llama on a local cluster give one engine's greedy outputs, and
a replica killed mid-run loses no request."""

import gc

import pytest

ray = pytest.importorskip("ray")

from liteinfer import LLM, SamplingParams  # noqa: E402

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
    with LLM(str(tiny_llama_dir), **OPTIONS) as llm:
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]


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
    assert [out.outputs[0].token_ids for out in outputs] == expected[:8]
    assert streamed == outputs[0].outputs[0].text

def test_two_replicas_serve_32_requests_with_one_engines_greedy_outputs(replicas, expected):
    outputs = replicas.generate(PROMPTS, GREEDY)
    assert [out.prompt for out in outputs] == PROMPTS  # in order
    assert [out.outputs[0].token_ids for out in outputs] == expected
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
    """Greedy requests of the dead replica are retried on the other one: every request finishes, same tokens."""
    engine = replicas.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"kill-{i}", prompt, GREEDY)
    finished = {}
    for _ in range(4):  # both replicas under way
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    victim = engine.replicas[0]
    assert victim.requests, "the victim should hold unfinished requests"
    ray.kill(victim.actor, no_restart=True)
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    assert not victim.alive
    assert sorted(finished) == sorted(f"kill-{i}" for i in range(len(PROMPTS)))
    assert [finished[f"kill-{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == expected
    assert all(out.error is None for out in finished.values())

