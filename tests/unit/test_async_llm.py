"""AsyncLLM over a tiny random Llama: batching, streaming, cancellation and backpressure."""

import asyncio
import gc
from dataclasses import replace

import pytest

from liteinfer import LLM, RequestOutputKind, SamplingParams
from liteinfer.engine.async_llm import AsyncLLM, EngineOverloadedError

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Hello, my name is"]
GREEDY = SamplingParams(temperature=0, max_tokens=10)
# Long enough to still be running while a test does something else with the engine.
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    """Started and stopped by each test (`async with llm`), loaded once."""
    return AsyncLLM(str(tiny_llama_dir), dtype="float32")


@pytest.fixture(scope="module")
def sync_llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32")


def assert_idle_and_all_blocks_free(llm: AsyncLLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


async def collect(events) -> list:
    return [event async for event in events]


def test_generate_concurrent_calls_equal_sync_generate_greedy(llm, sync_llm):
    expected = [o.outputs[0].token_ids for o in sync_llm.generate(PROMPTS, GREEDY)]

    async def main():
        async with llm:
            return await asyncio.gather(
                llm.generate(PROMPTS, GREEDY), llm.generate(PROMPTS[2:], GREEDY), llm.generate(PROMPTS[0], GREEDY)
            )

    everything, tail, first = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in everything] == expected
    assert [o.outputs[0].token_ids for o in tail] == expected[2:]
    assert first[0].outputs[0].token_ids == expected[0]
    assert [o.prompt for o in everything] == PROMPTS
    assert_idle_and_all_blocks_free(llm)


def test_stream_deltas_concatenate_to_the_final_text_one_event_per_token(llm, sync_llm):
    reference = sync_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    # A stop string across a token boundary in the middle of the answer: its first half is in the text for a step
    # before the second half completes it, and the stream must never show text it later takes back.
    decoded = [sync_llm.tokenizer.decode(reference.token_ids[:i]) for i in range(len(reference.token_ids))]
    stop = next(
        stop
        for end in map(len, decoded[3:])
        if reference.text.find(stop := reference.text[end - 2 : end + 2]) == end - 2 and len(stop) == 4
    )
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    expected = sync_llm.generate(PROMPTS[1], params)[0].outputs[0]
    assert expected.finish_reason == "stop" and expected.stop_reason == stop

    async def main():
        async with llm:
            return await collect(llm.stream(PROMPTS[1], params))

    events = asyncio.run(main())
    assert "".join(event.delta for event in events) == events[-1].text == expected.text
    assert events[-1].token_ids == expected.token_ids
    assert [len(event.token_ids) for event in events] == list(range(1, len(expected.token_ids) + 1))
    assert all(len(event.new_token_ids) == 1 for event in events)
    assert [event.finished for event in events] == [False] * (len(events) - 1) + [True]
    assert (events[-1].finish_reason, events[-1].stop_reason) == ("stop", stop)
    assert all(event.text.startswith(previous.text) for previous, event in zip(events, events[1:]))


def test_stream_with_n_samples_matches_sync_per_sample(llm, sync_llm):
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=12, logprobs=1)
    expected = sync_llm.generate(PROMPTS[0], params)[0].outputs

    async def main():
        async with llm:
            return await collect(llm.stream(PROMPTS[0], params))

    events = asyncio.run(main())
    for sample in expected:
        mine = [event for event in events if event.index == sample.index]
        assert "".join(event.delta for event in mine) == sample.text
        assert mine[-1].token_ids == sample.token_ids and mine[-1].finished
        assert [lp for event in mine for lp in event.logprobs] == sample.logprobs


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_stream_events_do_not_depend_on_the_output_kind_asked_for(llm, kind):
    """The events say what they say (text and ids so far, what is new) whichever kind the params ask the engine for:
    DELTA streams the same events as CUMULATIVE (the default), FINAL_ONLY one event a sample with all of it."""
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=1)

    async def main():
        async with llm:
            return (await collect(llm.stream(PROMPTS[0], params)),
                    await collect(llm.stream(PROMPTS[0], replace(params, output_kind=kind))))

    cumulative, other = asyncio.run(main())
    without_id = [replace(event, request_id="") for event in cumulative]
    if kind is RequestOutputKind.DELTA:
        assert [replace(event, request_id="") for event in other] == without_id
    else:
        last = [event for event in without_id if event.finished]
        assert len(other) == 2 and all(event.finished for event in other)
        for event, final in zip(sorted(other, key=lambda event: event.index), last, strict=True):
            mine = [e for e in without_id if e.index == event.index]
            assert replace(event, request_id="") == replace(
                final, delta=final.text, new_token_ids=final.token_ids,
                logprobs=[lp for e in mine for lp in e.logprobs])


def test_closing_or_dropping_submitted_events_unread_aborts_the_requests(llm):
    async def main():
        async with llm:
            closed = await llm.submit(PROMPTS[:2], LONG)
            await closed.aclose()
            dropped = await llm.submit(PROMPTS[2:], LONG)
            del dropped
            gc.collect()
            await llm.generate(PROMPTS[1], GREEDY)  # a few more steps, for the aborts to have gone through
            assert_idle_and_all_blocks_free(llm)

    asyncio.run(main())


def test_stream_started_later_joins_the_running_batch(llm, sync_llm):
    expected_late = sync_llm.generate(PROMPTS[2], GREEDY)[0].outputs[0].token_ids
    order: list[str] = []

    async def main():
        async with llm:
            early_started = asyncio.Event()

            async def early():
                async for event in llm.stream(PROMPTS[0], LONG, request_id="early"):
                    order.append("early")
                    if len(event.token_ids) == 3:
                        early_started.set()

            async def late():
                await early_started.wait()
                async for event in llm.stream(PROMPTS[2], GREEDY, request_id="late"):
                    order.append("late")
                    token_ids = event.token_ids
                return token_ids

            return (await asyncio.gather(early(), late()))[1]

    assert asyncio.run(main()) == expected_late
    # The late request ran to the end while the early one kept going: continuous batching, not waiting its turn.
    last_late = len(order) - 1 - order[::-1].index("late")
    assert order.index("late") > 3 and "early" in order[last_late:]
    assert order.count("early") == LONG.max_tokens


def test_breaking_out_of_a_stream_aborts_it_and_spares_the_others(llm, sync_llm):
    expected = sync_llm.generate(PROMPTS[3], GREEDY)[0].outputs[0].text

    async def main():
        async with llm:
            async def quitter():
                async for event in llm.stream(PROMPTS[0], LONG):
                    if len(event.token_ids) == 3:
                        break

            _, events = await asyncio.gather(quitter(), collect(llm.stream(PROMPTS[3], GREEDY)))
            # The other request finished long before LONG's 200 tokens: had the quitter not been aborted, it would
            # still hold its blocks here.
            assert_idle_and_all_blocks_free(llm)
            return "".join(event.delta for event in events)

    assert asyncio.run(main()) == expected


def test_cancelling_the_reading_task_aborts_its_request(llm):
    async def main():
        async with llm:
            first_token = asyncio.Event()

            async def reader():
                async for _ in llm.stream(PROMPTS[0], LONG):
                    first_token.set()

            task = asyncio.create_task(reader())
            await first_token.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await llm.generate(PROMPTS[1], GREEDY)  # a few more steps, for the abort to have gone through
            assert_idle_and_all_blocks_free(llm)

    asyncio.run(main())


def test_cancelling_generate_aborts_all_its_requests(llm):
    async def main():
        async with llm:
            task = asyncio.create_task(llm.generate(PROMPTS, LONG))
            while not llm.engine.scheduler.running:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await llm.generate(PROMPTS[1], GREEDY)
            assert_idle_and_all_blocks_free(llm)

    asyncio.run(main())


def test_abort_ends_the_stream_with_reason_abort_and_frees_blocks(llm):
    async def main():
        async with llm:
            events = []
            async for event in llm.stream(PROMPTS[0], LONG, request_id="victim"):
                events.append(event)
                if len(events) == 2:
                    await llm.abort("victim")
            assert_idle_and_all_blocks_free(llm)
            await llm.abort("no-such-request")  # unknown ids are ignored
            return events

    events = asyncio.run(main())
    assert events[-1].finished and events[-1].finish_reason == "abort"
    assert len(events[-1].token_ids) < LONG.max_tokens


def test_leaving_the_context_aborts_open_streams_and_frees_every_block(llm):
    async def main():
        events = []
        async with llm:
            async def reader():
                async for event in llm.stream(PROMPTS[0], LONG):
                    events.append(event)

            task = asyncio.create_task(reader())
            while len(events) < 2:
                await asyncio.sleep(0.01)
        await task  # ends by itself: the reader got its final event
        return events

    events = asyncio.run(main())
    assert events[-1].finish_reason == "abort"
    assert_idle_and_all_blocks_free(llm)


def test_invalid_prompt_raises_and_queues_nothing(llm):
    async def main():
        async with llm:
            with pytest.raises(ValueError, match="empty"):
                await llm.generate([PROMPTS[0], ""], GREEDY)
            with pytest.raises(ValueError, match="max_model_len"):
                await collect(llm.stream({"prompt_token_ids": [1] * llm.max_model_len}, GREEDY))
            assert_idle_and_all_blocks_free(llm)

    asyncio.run(main())


def test_requests_outside_the_context_raise_runtime_error(llm):
    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(llm.generate(PROMPTS[0], GREEDY))


def test_more_waiting_than_max_waiting_seqs_raises_overloaded(tiny_llama_dir, sync_llm):
    expected = sync_llm.generate(PROMPTS[1], GREEDY)[0].outputs[0].text
    # One running sequence at a time and room for one more in the queue.
    llm = AsyncLLM(str(tiny_llama_dir), dtype="float32", max_num_seqs=1, max_waiting_seqs=1)

    async def main():
        async with llm:
            # Two at once can never wait here: not an overload to retry later but a request to split.
            with pytest.raises(ValueError, match="max_waiting_seqs=1"):
                await llm.generate(PROMPTS[:2], GREEDY)
            with pytest.raises(ValueError, match="max_waiting_seqs=1"):
                await llm.generate(PROMPTS[0], SamplingParams(n=2))
            assert_idle_and_all_blocks_free(llm)

            running = llm.stream(PROMPTS[0], LONG)
            await anext(running)  # now running, the queue is empty
            queued = await llm.submit([PROMPTS[1]], GREEDY)  # waits behind it
            with pytest.raises(EngineOverloadedError):
                await llm.generate(PROMPTS[2], GREEDY)
            await running.aclose()  # frees the engine for the queued one, which was never disturbed
            return "".join([event.delta async for event in queued])

    assert asyncio.run(main()) == expected
    assert_idle_and_all_blocks_free(llm)


def test_max_waiting_seqs_below_one_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_waiting_seqs"):
        AsyncLLM(str(tiny_llama_dir), max_waiting_seqs=0)


def test_engine_failure_reaches_the_reader_and_stops_the_loop(llm, monkeypatch):
    def broken_step():
        raise RuntimeError("device lost")

    async def main():
        async with llm:
            monkeypatch.setattr(llm.engine, "step", broken_step)
            with pytest.raises(RuntimeError, match="engine loop failed"):
                await llm.generate(PROMPTS[0], GREEDY)
            assert not llm.is_running and "device lost" in str(llm.error)
            with pytest.raises(RuntimeError, match="has failed"):
                await llm.generate(PROMPTS[0], GREEDY)
            monkeypatch.undo()

    asyncio.run(main())
    assert_idle_and_all_blocks_free(llm)  # leaving the context aborted what the failed loop left behind


def test_a_speculative_stream_carries_each_steps_kept_tokens_in_one_event(tiny_llama_dir, sync_llm):
    """With speculative decoding a step may keep several tokens: their event carries them all, with their text and
    logprobs, and the events still add up to the plain engine's sample."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0,
                            allowed_token_ids=list(range(300, 305)))  # a random model's text, made to repeat
    expected = sync_llm.generate(PROMPTS[0], params)[0].outputs[0]
    speculative = AsyncLLM(str(tiny_llama_dir), dtype="float32",
                           speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1})

    async def main():
        async with speculative:
            return await collect(speculative.stream(PROMPTS[0], params))

    events = asyncio.run(main())
    assert "".join(event.delta for event in events) == events[-1].text == expected.text
    assert [t for event in events for t in event.new_token_ids] == events[-1].token_ids == expected.token_ids
    assert all(len(event.logprobs) == len(event.new_token_ids) for event in events)
    assert max(len(event.new_token_ids) for event in events) > 1
    assert_idle_and_all_blocks_free(speculative)
