"""Tool calling over the OpenAI API (vLLM's rules): a named function's arguments kept to its schema, "required"'s
calls, "auto"'s calls found by the server's tool parser, streamed and whole, against a tiny random Llama. Where the
random model's text must hold a call, the request's own format (guided_choice) makes it write one."""

import http.client
import json
import shutil

import openai
import pytest
from test_server import request, running_server
from transformers import AutoTokenizer

from liteinfer import LLM
from liteinfer.engine.async_llm import AsyncLLM
from liteinfer.entrypoints.openai.protocol import ChatCompletionRequest
from liteinfer.entrypoints.openai.server import build_app

MODEL = "tiny-llama"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                                "maximum": 7}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"enum": ["CET", "UTC"]}}}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TEXT = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'


# A chat template that shows the model its tools and a history's calls, as Qwen's and Hermes' do.
TOOLS_TEMPLATE = (
    "{% if tools %}{{ 'tools: ' + (tools | tojson) + '\n' }}{% endif %}"
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] }}"
    "{% for call in message.get('tool_calls', []) %}{{ ' <tool_call>' + (call['function'] | tojson) + '</tool_call>' }}"
    "{% endfor %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tools_model(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with TOOLS_TEMPLATE as its chat template."""
    directory = tmp_path_factory.mktemp("tiny-llama-tools")
    shutil.copytree(tiny_llama_dir, directory, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def served(tools_model):
    """(port of a server with the hermes tool parser, port of one without)."""
    with_parser, without = AsyncLLM(str(tools_model), dtype="float32"), AsyncLLM(str(tools_model), dtype="float32")
    with running_server(build_app(with_parser, MODEL, tool_call_parser="hermes")) as port, \
            running_server(build_app(without, MODEL)) as plain_port:
        yield port, plain_port


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served[0]}/v1", api_key="none", max_retries=0, timeout=60)


def chat(client, stream=False, max_tokens=48, **fields):
    return client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=max_tokens,
                                          stream=stream, **fields)


def streamed(client, **fields) -> tuple[str, dict[int, dict], list[str | None]]:
    """(the content deltas joined, each call's pieces merged by index, the finish reasons)."""
    content, calls, finishes = "", {}, []
    for chunk in chat(client, stream=True, **fields):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finishes.append(choice.finish_reason)
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or piece.id
                call["name"] = call["name"] or piece.function.name
                call["arguments"] += piece.function.arguments or ""
    return content, calls, finishes


def test_a_named_function_gets_arguments_that_keep_to_its_schema(client):
    choice = chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                              "function": {"name": "get_weather"}}).choices[0]
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert set(arguments) == {"city", "days"} and arguments["city"] in ("Paris", "Rome") and 1 <= arguments["days"] <= 7
    assert choice.message.content == "" and choice.finish_reason == "stop"  # vLLM's for a named function

    content, calls, finishes = streamed(client, tools=[WEATHER, TIME],
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert content == "" and finishes[-1] == "stop"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]
    assert calls[0]["id"].startswith("chatcmpl-tool-")


def test_required_makes_a_call_of_one_of_the_tools(client):
    """parallel_tool_calls false: exactly one call (the random model would go on adding calls to its array)."""
    one = {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    choice = chat(client, **one).choices[0]
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    arguments = json.loads(calls[0].function.arguments)
    assert set(arguments) == ({"city", "days"} if calls[0].function.name == "get_weather" else {"zone"})
    assert choice.finish_reason == "tool_calls"

    content, streamed_calls, finishes = streamed(client, **one)
    assert finishes[-1] == "tool_calls" and not content
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls.values()] == [
        (call.function.name, json.loads(call.function.arguments)) for call in calls]


def test_auto_finds_the_calls_in_the_answer_and_keeps_the_text_before_them(client):
    choice = chat(client, tools=[WEATHER], extra_body={"guided_choice": [CALL_TEXT]}).choices[0]
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    assert choice.finish_reason == "tool_calls"

    # Streamed: the text before the call as content (never a piece of the tag), the call whole at the end.
    content, calls, finishes = streamed(client, tools=[WEATHER], extra_body={"guided_choice": [CALL_TEXT]})
    assert content == "Let me check." and finishes[-1] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris", "days": 2})]


def test_auto_with_an_answer_in_words_is_content(client):
    answer = "It is sunny <b>today</b>."
    choice = chat(client, tools=[WEATHER], tool_choice="auto", extra_body={"guided_choice": [answer]}).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (answer, [], "stop")
    content, calls, finishes = streamed(client, tools=[WEATHER], extra_body={"guided_choice": [answer]})
    assert (content, calls, finishes[-1]) == (answer, {}, "stop")


def test_required_asks_for_one_call_or_more_unless_parallel_calls_are_off():
    request_body = {"messages": QUESTION, "tools": [WEATHER, TIME], "tool_choice": "required"}
    for parallel, most in ((None, None), (True, None), (False, 1)):
        body = ChatCompletionRequest.model_validate({**request_body, "parallel_tool_calls": parallel})
        schema = body.sampling_params({}, 16, None).structured_outputs.json
        assert schema["minItems"] == 1 and schema.get("maxItems") == most
        assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [["get_weather"],
                                                                                             ["get_time"]]


def test_required_refuses_two_tools_that_define_one_type_two_ways():
    def tool(name, colors):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "$defs": {"Color": {"enum": colors}}, "properties": {"c": {"$ref": "#/$defs/Color"}}}}}

    body = ChatCompletionRequest.model_validate({"messages": QUESTION, "tool_choice": "required",
                                                 "tools": [tool("a", ["red"]), tool("b", ["red"])]})
    assert body.sampling_params({}, 16, None).structured_outputs.json["$defs"] == {"Color": {"enum": ["red"]}}
    body = ChatCompletionRequest.model_validate({"messages": QUESTION, "tool_choice": "required",
                                                 "tools": [tool("a", ["red"]), tool("b", ["blue"])]})
    with pytest.raises(ValueError, match=r"two tools define \$Color differently"):
        body.sampling_params({}, 16, None)


def test_none_leaves_the_answer_as_text_and_a_history_of_calls_is_taken(client):
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny"},
    ]
    response = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                              temperature=0, max_tokens=8)
    assert response.choices[0].message.tool_calls == [] and response.choices[0].message.content


def test_required_takes_tools_whose_schemas_define_their_own_types(client):
    """A tool's `$defs` (what pydantic's schemas carry) move to the calls' array schema, where its `$ref`s point."""
    color = {"type": "function", "function": {"name": "paint", "parameters": {
        "type": "object", "$defs": {"Color": {"enum": ["red", "blue"]}}, "additionalProperties": False,
        "properties": {"color": {"$ref": "#/$defs/Color"}}, "required": ["color"]}}}
    choice = chat(client, tools=[color, TIME], tool_choice="required", parallel_tool_calls=False).choices[0]
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert arguments in ({"color": "red"}, {"color": "blue"}, {"zone": "CET"}, {"zone": "UTC"})


def test_auto_keeps_only_the_first_call_when_parallel_calls_are_off(client):
    two_calls = CALL_TEXT + '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}</tool_call>'
    for parallel, count in ((None, 2), (False, 1)):
        fields = {"tools": [WEATHER], "parallel_tool_calls": parallel, "max_tokens": 96,
                  "extra_body": {"guided_choice": [two_calls]}}
        assert len(chat(client, **fields).choices[0].message.tool_calls) == count
        assert len(streamed(client, **fields)[1]) == count


def test_a_stream_sends_no_empty_chunks_while_it_holds_a_call_back(served):
    """Text held back (a call being written) makes no chunk of its own: the last one brings the call."""
    body = {"model": MODEL, "messages": QUESTION, "tools": [WEATHER], "stream": True, "temperature": 0,
            "max_tokens": 64, "guided_choice": [CALL_TEXT]}
    conn = http.client.HTTPConnection("127.0.0.1", served[0], timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    events = [line[6:] for line in conn.getresponse().read().decode().splitlines() if line.startswith("data: ")]
    chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
    assert events[-1] == "[DONE]" and chunks[0]["delta"]["role"] == "assistant"
    for choice in chunks[1:]:
        delta = choice["delta"]
        assert delta.get("content") or delta.get("tool_calls") or choice["finish_reason"], choice


def test_tokenize_renders_the_tools_as_chat_does(served, tools_model):
    """/tokenize with messages and tools counts the prompt a chat request with those tools gets (the template writes
    the tools into the prompt)."""
    status, with_tools = request(served[0], "POST", "/tokenize", {"messages": QUESTION, "tools": [WEATHER]},
                                 api_key=None)
    status_without, without = request(served[0], "POST", "/tokenize", {"messages": QUESTION}, api_key=None)
    assert status == status_without == 200
    llm = LLM(str(tools_model), dtype="float32")
    assert with_tools["tokens"] == llm.apply_chat_template(QUESTION, tools=[WEATHER])
    assert without["tokens"] == llm.apply_chat_template(QUESTION) != with_tools["tokens"]
    chat = openai.OpenAI(base_url=f"http://127.0.0.1:{served[0]}/v1", api_key="none").chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert chat.usage.prompt_tokens == with_tools["count"]


@pytest.mark.parametrize("fields, message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice names the function 'get_time', which tools do not define"),
    ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
    ({"tool_choice": "auto"}, "tool_choice 'auto' needs tools"),
    ({"tools": [], "tool_choice": "auto"}, "tool_choice 'auto' needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tools: a tool's parameters do not compile"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "a required or named tool_choice sets the output's format"),
    ({"tools": [WEATHER], "tool_choice": "maybe"}, "tool_choice"),
])
def test_bad_tool_requests_are_400s_that_say_why(served, fields, message):
    status, body = request(served[0], "POST", "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, **fields},
                           api_key=None)
    assert status == 400 and message in body["error"]["message"], body


def test_auto_needs_a_server_with_a_tool_parser(served):
    status, body = request(served[1], "POST", "/v1/chat/completions",
                           {"model": MODEL, "messages": QUESTION, "tools": [WEATHER]}, api_key=None)
    assert status == 400 and "--enable-auto-tool-choice" in body["error"]["message"]
    assert body["error"]["param"] == "tool_choice"
