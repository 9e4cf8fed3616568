"""The OpenAI-compatible server on a loopback port, driven by the official `openai` client and by raw HTTP."""

import asyncio
import gc
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from liteinfer import LLM, SamplingParams
from liteinfer.engine.async_llm import AsyncLLM
from liteinfer.entrypoints.openai import server
from liteinfer.entrypoints.openai.protocol import ChatCompletionRequest
from liteinfer.entrypoints.openai.server import build_app

MODEL = "tiny-llama"
API_KEY = "test-key"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Hello, my name is"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@contextmanager
def running_server(app):
    """Serve `app` on a free loopback port from a background thread; yields the port."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(3000):  # at most ~30 s
        if server.started or not thread.is_alive():
            break
        time.sleep(0.01)
    assert server.started, "the server did not start"
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    """(AsyncLLM, port) of a server that requires API_KEY."""
    llm = AsyncLLM(str(tiny_llama_dir), dtype="float32")
    with running_server(build_app(llm, MODEL, api_key=API_KEY)) as port:
        yield llm, port
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def port(served):
    return served[1]


@pytest.fixture(scope="module")
def client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def sync_llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32")


@pytest.fixture(scope="module")
def expected(sync_llm):
    """prompt -> the greedy completion of MAX_TOKENS tokens, from `LLM.generate`."""
    return {prompt: out.outputs[0] for prompt, out in zip(PROMPTS, sync_llm.generate(PROMPTS, GREEDY))}


def request(port: int, method: str, path: str, body=None, api_key: str | None = API_KEY, timeout: float = 60):
    """(status, parsed JSON body) of one plain HTTP request; `body` bytes are sent as they are."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    try:
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        return response.status, json.loads(raw) if raw and raw[:1] in b"{[" else raw
    finally:
        conn.close()


def open_stream(port: int, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    response = conn.getresponse()
    assert response.status == 200
    return conn, response


def next_sse_data(response: http.client.HTTPResponse) -> dict:
    for _ in range(100):
        line = response.fp.readline().strip()
        if line.startswith(b"data: "):
            return json.loads(line[len(b"data: "):])
    raise AssertionError("no SSE data line")


def wait_until(condition, what: str, tries: int = 1000) -> None:
    for _ in range(tries):  # at most ~10 s
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# ------------------------------------------------------------------------------------------------------------
# The openai client


def test_completion_equals_llm_generate_with_correct_usage(client, expected, sync_llm):
    prompt = PROMPTS[0]
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    choice = result.choices[0]
    assert choice.text == expected[prompt].text
    assert choice.finish_reason == expected[prompt].finish_reason
    assert result.object == "text_completion" and result.model == MODEL
    num_prompt_tokens = len(sync_llm.tokenizer.encode(prompt))
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (
        num_prompt_tokens, len(expected[prompt].token_ids), num_prompt_tokens + len(expected[prompt].token_ids))


def test_completion_of_several_prompts_keeps_their_order(client, expected):
    result = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in result.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in result.choices] == [expected[p].text for p in PROMPTS]
    assert result.usage.completion_tokens == sum(len(expected[p].token_ids) for p in PROMPTS)


def test_completion_stream_concatenates_to_the_same_text_and_reports_usage(client, expected):
    prompt = PROMPTS[1]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    *token_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in token_chunks) == expected[prompt].text
    assert token_chunks[-1].choices[0].finish_reason == expected[prompt].finish_reason
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(expected[prompt].token_ids)
    assert len({c.id for c in chunks}) == 1


def test_chat_completion_equals_llm_chat(client, sync_llm):
    reference = sync_llm.chat(QUESTION, GREEDY)[0]
    result = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0)
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == reference.outputs[0].text
    assert result.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert result.usage.completion_tokens == len(reference.outputs[0].token_ids)


def test_chat_continuing_the_final_message_equals_llm_chat(client, sync_llm):
    started = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    reference = sync_llm.chat(started, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    assert sync_llm.tokenizer.decode(reference.prompt_token_ids).endswith("assistant\nThe capital of France is")
    result = client.chat.completions.create(
        model=MODEL, messages=started, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {}},
    )
    assert result.choices[0].message.content == reference.outputs[0].text
    assert result.usage.prompt_tokens == len(reference.prompt_token_ids)


def test_chat_stream_opens_with_the_role_and_concatenates_to_the_text(client, sync_llm):
    reference = sync_llm.chat(QUESTION, GREEDY)[0].outputs[0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference.text
    assert chunks[-1].choices[0].finish_reason == reference.finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_n_2_gives_two_seeded_samples_streamed_or_not(client, sync_llm):
    params = SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=MAX_TOKENS)
    samples = [s.text for s in sync_llm.generate(PROMPTS[0], params)[0].outputs]
    assert samples[0] != samples[1]
    args = dict(model=MODEL, prompt=PROMPTS[0], n=2, temperature=0.9, seed=3, max_tokens=MAX_TOKENS)
    whole = client.completions.create(**args)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == samples
    streamed = ["", ""]
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == samples


def test_stop_string_ends_the_completion_before_it(client, expected):
    text = expected[PROMPTS[2]].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert text.find(stop) == len(text) // 2
    result = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                       stop=[stop, "never appears"])
    assert result.choices[0].text == text[: len(text) // 2]
    assert result.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text[: len(text) // 2]


def test_logit_bias_allowed_token_ids_and_bad_words_reach_the_engine(client, sync_llm):
    """OpenAI's logit_bias (token ids as strings, biases clamped to [-100, 100] as vLLM does) and vLLM's extras."""
    reference = sync_llm.generate(PROMPTS[0], GREEDY)[0].outputs[0]
    forced = next(t for t in reference.token_ids if t != reference.token_ids[0])
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                       logit_bias={str(forced): 1000})
    assert result.choices[0].text == sync_llm.tokenizer.decode([forced] * 4)
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0,
                                          logit_bias={str(forced): 100}, logprobs=True)
    assert [lp.token for lp in chat.choices[0].logprobs.content] == [sync_llm.tokenizer.decode([forced])] * 4
    allowed = reference.token_ids[1:3]
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=0,
                                       extra_body={"allowed_token_ids": allowed})
    assert set(result.choices[0].logprobs.tokens) <= {sync_llm.tokenizer.decode([t]) for t in allowed}
    word = sync_llm.tokenizer.decode(reference.token_ids[:1])
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=0, extra_body={"bad_words": [word]})
    assert word not in result.choices[0].logprobs.tokens


def test_stop_token_ids_include_stop_str_in_output_and_skip_special_tokens_reach_the_engine(client, expected):
    reference = expected[PROMPTS[2]]
    at = next(i for i in range(2, len(reference.token_ids)) if reference.token_ids[i] not in reference.token_ids[:i])
    stop_id = reference.token_ids[at]
    result = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"stop_token_ids": [stop_id]})
    assert (result.choices[0].finish_reason, result.choices[0].stop_reason) == ("stop", stop_id)
    stop = reference.text[len(reference.text) // 2 :][:3]
    result = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                       stop=stop, extra_body={"include_stop_str_in_output": True})
    assert result.choices[0].text.endswith(stop) and result.choices[0].stop_reason == stop
    forced = {"logit_bias": {"1": 100}}  # <|im_start|>, a special token (not this model's EOS)
    for skip, text in ((True, ""), (False, "<|im_start|>" * 2)):
        result = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=2,
                                           extra_body={**forced, "skip_special_tokens": skip})
        assert result.choices[0].text == text


SHAPE = {"type": "object", "properties": {"shape": {"enum": ["circle", "square"]},
                                          "sides": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["shape", "sides"], "additionalProperties": False}


def test_structured_outputs_by_response_format_or_vllms_fields(client):
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs and guided_* fields."""
    compact = {"structured_outputs": {"json": SHAPE, "disable_any_whitespace": True}}
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0,
                                          extra_body=compact)
    shape = json.loads(chat.choices[0].message.content)
    assert shape["shape"] in ("circle", "square") and 0 <= shape["sides"] <= 9
    completion = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                           extra_body={"guided_choice": ["red", "green"]})
    assert completion.choices[0].text in ("red", "green") and completion.choices[0].finish_reason == "stop"
    completion = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                           extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", completion.choices[0].text)
    streamed = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=40, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "shape", "schema": SHAPE}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    # JSON may hold any whitespace between its tokens, which the random model writes until max_tokens ends it.
    assert re.match(r'\{\s*"shape"\s*:\s*"(circle|square)"', text), text


def test_logprobs_of_tokens_a_format_excludes_go_out_as_vllms_floor(port):
    """A format leaves most tokens -inf; JSON has no infinity, so they go out as -9999.0, as vLLM sends them."""
    for path, body in (("/v1/chat/completions", {"messages": QUESTION, "logprobs": True, "top_logprobs": 5}),
                       ("/v1/completions", {"prompt": PROMPTS[0], "logprobs": 5})):
        status, response = request(port, "POST", path, {**body, "model": MODEL, "max_tokens": 4, "temperature": 0,
                                                        "guided_choice": ["yes", "no"]})
        assert status == 200, response
        logprobs = response["choices"][0]["logprobs"]
        values = ([top["logprob"] for item in logprobs["content"] for top in item["top_logprobs"]] if "content"
                  in logprobs else [v for top in logprobs["top_logprobs"] for v in top.values()])
        assert -9999.0 in values and min(values) == -9999.0


def test_truncate_prompt_tokens_with_echo_echoes_the_prompt_the_model_saw(client, sync_llm):
    ids = sync_llm.tokenizer.encode(PROMPTS[0])
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0, echo=True,
                                       logprobs=0, extra_body={"truncate_prompt_tokens": 3})
    expected = sync_llm.generate({"prompt_token_ids": ids[-3:]}, SamplingParams(temperature=0, max_tokens=2))[0]
    assert result.choices[0].text == sync_llm.tokenizer.decode(ids[-3:]) + expected.outputs[0].text
    assert len(result.choices[0].logprobs.tokens) == 3 + 2 and result.usage.prompt_tokens == 3


def test_logit_bias_is_clamped_to_openais_range():
    body = ChatCompletionRequest(messages=QUESTION, logit_bias={"5": 1000.0, "6": -1e9, " 7": 0.5})
    assert body.sampling_params({}, 4, None).logit_bias == {5: 100.0, 6: -100.0, 7: 0.5}


def test_completion_top_logprobs_hold_the_chosen_token_too(client, sync_llm):
    """OpenAI's legacy logprobs: each position's top_logprobs hold the chosen token besides the top `logprobs` ones
    (so up to logprobs + 1 entries; only the chosen one at 0), echoed prompt tokens included."""
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=0,
                                       echo=True)
    logprobs = result.choices[0].logprobs
    assert logprobs.top_logprobs[0] is None  # the prompt's first token: nothing predicts it
    for token, chosen, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert top == {token: chosen}
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, logprobs=1, echo=True)
    prompt_positions = zip(logprobs.tokens[1:-4], logprobs.token_logprobs[1:-4],
                           result.choices[0].logprobs.top_logprobs[1:-1])
    assert all(top[token] == chosen and len(top) in (1, 2) for token, chosen, top in prompt_positions)
    assert any(len(top) == 2 for top in result.choices[0].logprobs.top_logprobs[1:-1])  # a prompt token not the top


def test_completion_logprobs_match_the_engine(client, sync_llm):
    reference = sync_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2))
    sample = reference[0].outputs[0]
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=2)
    logprobs = result.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([lp[t].logprob for t, lp in zip(sample.token_ids,
                                                                                      sample.logprobs)])
    assert "".join(logprobs.tokens) == sample.text
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(chosen)  # greedy: the chosen token is top-1


def test_echo_puts_the_prompt_and_its_logprobs_first_streamed_or_not(client, sync_llm):
    """As OpenAI's legacy API and vLLM (what evaluation harnesses score prompts with): the prompt's text before each
    choice's, and its tokens' logprobs before the choice's, the first token's null; a token prompt's text decoded."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2, prompt_logprobs=2)
    reference = sync_llm.generate(PROMPTS[0], params)[0]
    sample = reference.outputs[0]
    prompt_ids = reference.prompt_token_ids
    expected_logprobs = [None] + [position[t].logprob for t, position in zip(prompt_ids[1:],
                                                                               reference.prompt_logprobs[1:])]
    expected_logprobs += [position[t].logprob for t, position in zip(sample.token_ids, sample.logprobs)]
    options = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, logprobs=2, echo=True)
    for prompt in (PROMPTS[0], prompt_ids):
        result = client.completions.create(prompt=prompt, **options)
        choice = result.choices[0]
        assert choice.text == sync_llm.tokenizer.decode(prompt_ids) + sample.text
        if prompt == PROMPTS[0]:
            assert choice.text == PROMPTS[0] + sample.text
        logprobs = choice.logprobs
        assert logprobs.token_logprobs == pytest.approx(expected_logprobs)
        assert logprobs.tokens == [sync_llm.tokenizer.decode([t]) for t in prompt_ids + sample.token_ids]
        assert logprobs.top_logprobs[0] is None
        assert all(top[token] == chosen and len(top) in (2, 3) for token, chosen, top in
                   zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]))
        assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
        assert result.usage.prompt_tokens == len(prompt_ids)
        chunks = list(client.completions.create(prompt=prompt, stream=True, **options))
        assert "".join(c.choices[0].text for c in chunks) == choice.text
        streamed = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
        assert streamed == pytest.approx(expected_logprobs)
    # max_tokens 0: the prompt alone, as vLLM gives it (what older harnesses ask for).
    prompt_only = client.completions.create(prompt=PROMPTS[0], **{**options, "max_tokens": 0})
    assert prompt_only.choices[0].text == PROMPTS[0]
    assert prompt_only.choices[0].logprobs.token_logprobs == pytest.approx(expected_logprobs[: len(prompt_ids)])
    chunks = list(client.completions.create(prompt=PROMPTS[0], stream=True, **{**options, "max_tokens": 0}))
    assert "".join(c.choices[0].text for c in chunks) == PROMPTS[0]
    without_logprobs = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                                 temperature=0, echo=True, n=2)
    assert [c.text for c in without_logprobs.choices] == [PROMPTS[0] + sample.text] * 2
    assert all(c.logprobs is None for c in without_logprobs.choices)


def as_wire(positions, keep=lambda token_id, logprob: True) -> list:
    """RequestOutput.prompt_logprobs as the server's JSON carries them (vLLM's form): null, or token id (a string)
    -> its logprob, rank and text, for the entries `keep` takes."""
    return [None if position is None else
            {str(t): {"logprob": pytest.approx(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in position.items() if keep(t, lp)}
            for position in positions]


def test_prompt_logprobs_come_with_each_choice_and_the_chat_response(port, client, sync_llm):
    """vLLM's extra field: a completion's choices each carry their prompt's logprobs (the first position null),
    trimmed to the field's own top count when an echo with more logprobs made the engine compute more; a chat
    response carries its prompt's at the top level."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=3)
    references = sync_llm.generate(PROMPTS[:2], params)
    status, body = request(port, "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPTS[:2], "n": 2,
                                                             "max_tokens": MAX_TOKENS, "temperature": 0,
                                                             "prompt_logprobs": 3})
    assert status == 200
    expected = [as_wire(r.prompt_logprobs) for r in references for _ in range(2)]
    assert [choice["prompt_logprobs"] for choice in body["choices"]] == expected
    assert all(len(position) in (3, 4) for position in expected[0][1:])  # the top 3, and the prompt's token

    status, body = request(port, "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "echo": True,
                                                             "logprobs": 3, "prompt_logprobs": 1,
                                                             "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200
    prompt_ids = references[0].prompt_token_ids
    own_or_top = [lambda t, lp, own=own: t == own or lp.rank <= 1 for own in prompt_ids]
    assert body["choices"][0]["prompt_logprobs"] == [
        None, *(as_wire([position], keep)[0] for position, keep in zip(references[0].prompt_logprobs[1:],
                                                                         own_or_top[1:]))]
    assert all(len(top) in (3, 4) for top in body["choices"][0]["logprobs"]["top_logprobs"][1:])

    conversation = sync_llm.chat(QUESTION, params)[0]
    status, body = request(port, "POST", "/v1/chat/completions", {"model": MODEL, "messages": QUESTION,
                                                                  "max_tokens": MAX_TOKENS, "temperature": 0,
                                                                  "prompt_logprobs": 3})
    assert status == 200
    assert body["prompt_logprobs"] == as_wire(conversation.prompt_logprobs)
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    status, body = request(port, "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPTS[0]})
    assert body["choices"][0]["prompt_logprobs"] is None
    # 0 asks for nothing but the prompt's own tokens, which a stream cannot carry: let through as vLLM does.
    chunks = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, extra_body={"prompt_logprobs": 0})
    assert "".join(chunk.choices[0].text for chunk in chunks) == references[0].outputs[0].text


def test_fields_a_request_leaves_out_take_the_models_recommended_sampling(tiny_llama_dir, tmp_path):
    """As vLLM's server: the checkpoint's generation_config.json (here max_new_tokens and a temperature) fills the
    sampling fields a request does not set; a request's own values win."""
    directory = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, directory)
    generation_config = json.loads((directory / "generation_config.json").read_text())
    generation_config.update(do_sample=True, temperature=0.25, max_new_tokens=3)
    (directory / "generation_config.json").write_text(json.dumps(generation_config))
    llm = AsyncLLM(str(directory), dtype="float32")
    submitted = []
    submit = llm.submit
    llm.submit = lambda prompts, params, *args, **options: (submitted.append(params),
                                                            submit(prompts, params, *args, **options))[1]
    with running_server(build_app(llm, MODEL)) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        chat = client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body={"ignore_eos": True})
        own = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0,
                                             extra_body={"ignore_eos": True})
        completion = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=None,
                                               extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3 and own.usage.completion_tokens == 5
    assert completion.usage.completion_tokens == 3
    assert [(params.temperature, params.max_tokens) for params in submitted] == [(0.25, 3), (0, 5), (0.25, 3)]


def test_a_models_default_max_tokens_past_the_context_ends_at_the_context(tiny_llama_dir, tmp_path):
    """As vLLM's server: only a request's own max_tokens must fit the context; the model's recommended one (here far
    past the tiny model's 512 positions) ends the output where the context does, as an unset one does."""
    directory = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, directory)
    generation_config = json.loads((directory / "generation_config.json").read_text())
    generation_config.update(max_new_tokens=100_000)
    (directory / "generation_config.json").write_text(json.dumps(generation_config))
    llm = AsyncLLM(str(directory), dtype="float32", max_model_len=64)
    with running_server(build_app(llm, MODEL)) as port:
        prompt = {"model": MODEL, "prompt": [5] * 40, "temperature": 0, "ignore_eos": True}
        status, body = request(port, "POST", "/v1/completions", {**prompt, "max_tokens": None}, api_key=None)
        assert status == 200 and body["usage"]["completion_tokens"] == 64 - 40
        status, body = request(port, "POST", "/v1/chat/completions",
                               {"model": MODEL, "messages": QUESTION, "temperature": 0, "ignore_eos": True},
                               api_key=None)
        assert status == 200 and body["usage"]["total_tokens"] == 64
        status, body = request(port, "POST", "/v1/completions", {**prompt, "max_tokens": 30}, api_key=None)
        assert status == 400 and body["error"]["param"] == "max_tokens"


def test_chat_logprobs_list_the_top_alternatives(client):
    result = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    assert "".join(entry.token for entry in content) == result.choices[0].message.content
    for entry in content:
        assert [top.logprob for top in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                       reverse=True)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert bytes(entry.bytes).decode(errors="replace") == entry.token


def test_32_concurrent_streaming_clients_all_get_their_text(port, expected):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0,
                                    timeout=120)

        async def one(prompt):
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True)
            return "".join([chunk.choices[0].text async for chunk in stream])

        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
        texts = await asyncio.gather(*(one(prompt) for prompt in prompts))
        await client.close()
        return prompts, texts

    prompts, texts = asyncio.run(main())
    assert texts == [expected[prompt].text for prompt in prompts]


@pytest.fixture
def aborted(served, monkeypatch):
    """request id -> final output of every request the engine aborts during the test."""
    engine, outputs = served[0].engine, {}
    abort_request = engine.abort_request

    def spy(request_id):
        output = abort_request(request_id)
        if output is not None:
            outputs[request_id] = output
        return output

    monkeypatch.setattr(engine, "abort_request", spy)
    return outputs


def test_disconnecting_client_is_aborted_and_others_are_undisturbed(served, client, expected, aborted):
    llm, port = served

    def complete(prompt):
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)
        return "".join(chunk.choices[0].text for chunk in stream)

    conn, response = open_stream(port, {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True})
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(complete, prompt) for prompt in PROMPTS]
        request_id = next_sse_data(response)["id"] + "-0"
        response.close()
        conn.close()
        assert [other.result(timeout=60) for other in others] == [expected[prompt].text for prompt in PROMPTS]
    wait_until(lambda: request_id in aborted, "the disconnected request to be aborted")
    assert aborted[request_id].outputs[0].finish_reason == "abort"
    assert len(aborted[request_id].outputs[0].token_ids) < 400
    wait_until(lambda: not llm.engine.has_unfinished_requests(), "the engine to go idle")
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_client_leaving_before_a_whole_response_aborts_it(served, aborted):
    llm, port = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    wait_until(llm.engine.has_unfinished_requests, "the request to be queued")
    conn.close()
    wait_until(lambda: aborted, "the request to be aborted")
    [output] = aborted.values()
    assert output.prompt == PROMPTS[1] and output.outputs[0].finish_reason == "abort"
    wait_until(lambda: not llm.engine.has_unfinished_requests(), "the engine to go idle")


def test_request_failing_in_the_engine_gets_a_500_error_and_the_server_goes_on(served, client, monkeypatch):
    llm, port = served
    append_token = llm.engine._append_token

    def fail_marked(request, seq, out, row):
        if seq.params.max_tokens == 7:  # the marked requests below
            raise RuntimeError("injected failure")
        return append_token(request, seq, out, row)

    monkeypatch.setattr(llm.engine, "_append_token", fail_marked)
    status, response = request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 7})
    assert status == 500 and "injected failure" in response["error"]["message"]
    assert response["error"]["type"] == "server_error"
    with pytest.raises(openai.APIError, match="injected failure"):
        list(client.completions.create(model=MODEL, prompt="hi", max_tokens=7, stream=True))
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


# ------------------------------------------------------------------------------------------------------------
# The other routes


def test_models_health_version_and_tokenize_round_trip(port, sync_llm):
    status, models = request(port, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL]
    assert request(port, "GET", "/health", api_key=None)[0] == 200
    status, version = request(port, "GET", "/version", api_key=None)
    assert status == 200 and version["version"]
    status, tokenized = request(port, "POST", "/tokenize", {"prompt": PROMPTS[0]})
    assert status == 200 and tokenized["tokens"] == sync_llm.tokenizer.encode(PROMPTS[0])
    assert tokenized["count"] == len(tokenized["tokens"])
    status, chat = request(port, "POST", "/tokenize", {"messages": QUESTION})
    assert status == 200 and chat["tokens"] == sync_llm.apply_chat_template(QUESTION)
    status, chat = request(port, "POST", "/tokenize", {"messages": QUESTION, "add_generation_prompt": False,
                                                       "continue_final_message": True})
    assert status == 200 and chat["tokens"] == sync_llm.apply_chat_template(QUESTION, False, True)
    status, detokenized = request(port, "POST", "/detokenize", {"tokens": tokenized["tokens"]})
    assert status == 200 and detokenized["prompt"] == PROMPTS[0]


def test_metrics_parse_and_count_the_traffic(port, client):
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    status, text = request(port, "GET", "/metrics", api_key=None)
    assert status == 200
    samples = {s.name: s.value for family in text_string_to_metric_families(text.decode()) for s in family.samples}
    assert samples["liteinfer_num_seqs_running"] >= 0 and samples["liteinfer_num_seqs_waiting"] >= 0
    assert 0 <= samples["liteinfer_kv_cache_usage_ratio"] <= 1
    assert samples["liteinfer_prefix_cache_queried_tokens"] >= samples["liteinfer_prefix_cache_hit_tokens"] >= 0
    assert 0 <= samples["liteinfer_prefix_cache_hit_ratio"] <= 1
    # No speculative decoding here: nothing drafted.
    assert samples["liteinfer_spec_decode_draft_tokens"] == samples["liteinfer_spec_decode_accepted_tokens"] == 0
    assert samples["liteinfer_prompt_tokens_total"] > 0
    assert samples["liteinfer_generation_tokens_total"] >= MAX_TOKENS
    assert samples["liteinfer_time_to_first_token_seconds_count"] >= 1
    assert samples["liteinfer_inter_token_latency_seconds_count"] >= MAX_TOKENS - 1


# ------------------------------------------------------------------------------------------------------------
# Bad input: OpenAI's error shape with the right status, and the server goes on


TOO_LONG = {"model": MODEL, "prompt": [1] * 600}
BAD_REQUESTS = {
    "malformed JSON": ("POST", "/v1/completions", b'{"model": "tiny-llama", "prompt": ', 400, None),
    "not an object": ("POST", "/v1/completions", b"[1, 2]", 400, None),
    "wrong type": ("POST", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    "wrong nested type": ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400,
                          "messages.0.content.str"),
    "missing field": ("POST", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    "bad value": ("POST", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    "bad n": ("POST", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    "max_tokens 0 without echo": ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    "bad top_p": ("POST", "/v1/chat/completions", {"messages": QUESTION, "top_p": 0}, 400, "top_p"),
    "too many logprobs": ("POST", "/v1/completions", {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    "empty prompt": ("POST", "/v1/completions", {"prompt": ""}, 400, None),
    "unsupported field": ("POST", "/v1/chat/completions", {"messages": QUESTION, "functions": [{"name": "f"}]},
                          400, None),
    "a tool of no known type": ("POST", "/v1/chat/completions", {"messages": QUESTION, "tools": [{"type": "x"}]},
                                400, "tools.0.type"),
    "echo of a token prompt out of the vocabulary": ("POST", "/v1/completions",
                                                     {"prompt": [1, 10**9], "echo": True}, 400, None),
    "unknown model": ("POST", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),  # OpenAI's, vLLM's
    "generation prompt and continued message": ("POST", "/v1/chat/completions",
                                                {"messages": QUESTION, "continue_final_message": True}, 400,
                                                "continue_final_message"),
    "chat_template_kwargs not the template's": ("POST", "/v1/chat/completions",
                                                {"messages": QUESTION, "chat_template_kwargs": {"tokenize": True}},
                                                400, "chat_template_kwargs"),
    "chat_template_kwargs not an object": ("POST", "/tokenize", {"messages": QUESTION, "chat_template_kwargs": [1]},
                                           400, "chat_template_kwargs"),
    "prompt too long": ("POST", "/v1/completions", TOO_LONG, 400, None),
    # As OpenAI's API and vLLM's server: refused, where LLM.generate would end the output at the context's end.
    "max_tokens past the context": ("POST", "/v1/completions", {"prompt": [1] * 500, "max_tokens": 100}, 400,
                                    "max_tokens"),
    "max_tokens past the context, chat": ("POST", "/v1/chat/completions",
                                          {"messages": QUESTION, "max_completion_tokens": 100_000}, 400, "max_tokens"),
    # As vLLM: a streamed response has nowhere to carry them.
    "prompt_logprobs streamed": ("POST", "/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
                                 400, "prompt_logprobs"),
    "prompt_logprobs streamed, chat": ("POST", "/v1/chat/completions",
                                       {"messages": QUESTION, "prompt_logprobs": 1, "stream": True}, 400,
                                       "prompt_logprobs"),
    "negative prompt_logprobs": ("POST", "/v1/completions", {"prompt": "hi", "prompt_logprobs": -2}, 400,
                                 "prompt_logprobs"),
    "prompt_logprobs past max_logprobs": ("POST", "/v1/chat/completions", {"messages": QUESTION,
                                                                           "prompt_logprobs": 21}, 400,
                                          "prompt_logprobs"),
    "stream_options without stream": ("POST", "/v1/completions",
                                      {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
                                      "stream_options"),
    "logit_bias key not a token id": ("POST", "/v1/completions", {"prompt": "hi", "logit_bias": {"the": 1}}, 400,
                                      "logit_bias"),
    "logit_bias token out of the vocabulary": ("POST", "/v1/chat/completions",
                                               {"messages": QUESTION, "logit_bias": {"49152": 1}}, 400, "logit_bias"),
    "logit_bias not a number": ("POST", "/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": NaN}}', 400,
                                "logit_bias"),
    "empty allowed_token_ids": ("POST", "/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, 400,
                                "allowed_token_ids"),
    "a schema that does not compile": ("POST", "/v1/chat/completions",
                                       {"messages": QUESTION, "response_format": {
                                           "type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
                                       400, "structured_outputs"),
    "json_schema without a schema": ("POST", "/v1/chat/completions",
                                     {"messages": QUESTION, "response_format": {"type": "json_schema"}}, 400,
                                     "response_format"),
    "two formats": ("POST", "/v1/completions", {"prompt": "hi", "guided_regex": "a", "structured_outputs": {
        "regex": "b"}}, 400, "structured_outputs"),
    "structured_outputs naming no format": ("POST", "/v1/completions", {"prompt": "hi", "structured_outputs": {}},
                                            400, "structured_outputs"),
    "unknown structured_outputs field": ("POST", "/v1/completions", {"prompt": "hi", "structured_outputs": {
        "yaml": "x"}}, 400, "structured_outputs"),
    "bad token id": ("POST", "/detokenize", {"tokens": [-1]}, 400, None),
    # A lone surrogate is valid JSON ("\\ud800") but no text: the tokenizer cannot take it.
    "not Unicode": ("POST", "/v1/completions", {"prompt": "hi \ud800"}, 400, None),
    "not Unicode, chat": ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
                          400, None),
    "not Unicode, tokenize": ("POST", "/tokenize", {"prompt": "\ud800"}, 400, None),
    "more samples than may ever wait": ("POST", "/v1/completions", {"prompt": "hi", "n": 5000}, 400, None),
    "unknown route": ("GET", "/v1/nothing-here", None, 404, None),
    "wrong method": ("GET", "/v1/completions", None, 405, None),
}


REFUSED_WITH_THEIR_OWN_WORDS = {
    "best_of": ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of is not supported by this server"),
    "functions": ("/v1/chat/completions", {"messages": QUESTION, "functions": [{"name": "f"}]},
                  "functions is not supported by this server"),  # the deprecated form of tools
    "prompt and messages": ("/tokenize", {"prompt": "hi", "messages": QUESTION},
                            "give exactly one of prompt and messages"),
}


@pytest.mark.parametrize("case", list(REFUSED_WITH_THEIR_OWN_WORDS))
def test_a_request_refused_as_a_whole_says_why(port, case):
    path, body, message = REFUSED_WITH_THEIR_OWN_WORDS[case]
    status, response = request(port, "POST", path, body)
    assert (status, response["error"]["message"]) == (400, message)


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_its_status_and_an_openai_error(port, case):
    method, path, body, expected_status, expected_param = BAD_REQUESTS[case]
    status, response = request(port, method, path, body)
    assert status == expected_status
    error = response["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    assert error["param"] == expected_param
    assert request(port, "GET", "/health", api_key=None)[0] == 200


@pytest.mark.parametrize("api_key", [None, "wrong-key"])
def test_missing_or_wrong_api_key_gets_401(port, api_key):
    status, response = request(port, "POST", "/v1/completions", {"prompt": "hi"}, api_key=api_key)
    assert status == 401 and response["error"]["code"] == "invalid_api_key"
    assert request(port, "GET", "/v1/models", api_key=api_key)[0] == 401


def test_overloaded_server_answers_503_and_recovers(tiny_llama_dir):
    # One running sequence and room for one more in the queue; the third request is refused.
    llm = AsyncLLM(str(tiny_llama_dir), dtype="float32", max_num_seqs=1, max_waiting_seqs=1)
    long = {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True}
    with running_server(build_app(llm, MODEL)) as port:
        running = open_stream(port, long)
        next_sse_data(running[1])  # it has a token: it is running
        queued = open_stream(port, long)  # the status line comes once the request is queued
        status, response = request(port, "POST", "/v1/completions", {"prompt": "hi"})
        assert status == 503 and response["error"]["type"] == "overloaded_error"
        for conn, response in (running, queued):
            response.close()
            conn.close()
        wait_until(lambda: not llm.engine.has_unfinished_requests(), "the streams to be aborted")
        status, response = request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and response["usage"]["completion_tokens"] == 2


# ------------------------------------------------------------------------------------------------------------
# The command


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_command_serves_until_interrupted(tiny_llama_dir):
    port = free_port()
    command = [sys.executable, "-m", "liteinfer.entrypoints.cli", "serve", "--model", str(tiny_llama_dir),
               "--port", str(port), "--served-model-name", MODEL, "--max-model-len", "256"]
    env = {**os.environ, "LITEINFER_API_KEY": API_KEY}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):  # at most ~60 s for python, torch and the model to load
            try:
                if request(port, "GET", "/health", api_key=None, timeout=1)[0] == 200:
                    break
            except OSError:
                pass
            assert process.poll() is None, process.stdout.read().decode()
            time.sleep(0.1)
        status, models = request(port, "GET", "/v1/models")
        assert status == 200 and models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 256
        assert request(port, "GET", "/v1/models", api_key=None)[0] == 401
    finally:
        process.send_signal(signal.SIGINT)
        output = process.communicate(timeout=30)[0].decode()
    assert process.returncode == 0, output
    assert "Traceback" not in output


def test_serve_moves_the_start_up_heap_out_of_the_collectors_reach(monkeypatch):
    """A full garbage collection scans every object the process tracks: after start-up ~0.2 s, the engine loop
    stopped meanwhile. `serve` freezes what start-up made before it serves."""
    frozen_when_serving = []
    monkeypatch.setattr(server, "AsyncLLM", lambda model, **options: object())
    monkeypatch.setattr(server, "build_app", lambda llm, name, api_key, tool_call_parser: object())
    monkeypatch.setattr(server.uvicorn.Server, "run",
                        lambda self, sockets: frozen_when_serving.append(gc.get_freeze_count()))
    try:
        server.serve("a model", "127.0.0.1", 0, served_model_name=MODEL)
    finally:
        gc.unfreeze()
    assert frozen_when_serving[0] > 0
