"""Chat conversations rendered with a tokenizer's template (engine/prompts.py: render_chat), on SmolLM2's tokenizer."""

import copy

import pytest

from liteinfer import SamplingParams
from liteinfer.engine.prompts import pair_prompts, render_chat

QUESTION = {"role": "user", "content": "What is 2 + 2?"}
STARTED_REPLY = {"role": "assistant", "content": "The answer is"}


@pytest.mark.parametrize(("prompts", "params", "match"), [
    (None, None, "prompts are a prompt or a list of them, got NoneType"),
    (3, None, "prompts are a prompt or a list of them, got int"),
    (["hi"], {"temperature": 0}, "sampling params are a SamplingParams or a list of them"),
    (["hi"], 0.5, "sampling params are a SamplingParams or a list of them"),
    (["hi"], [{"temperature": 0}], "sampling params are a SamplingParams or a list of them"),
])
def test_prompts_and_params_of_the_wrong_kind_are_a_value_error(prompts, params, match):
    """As every other bad input: a ValueError naming what was expected (a TypeError from deeper down before)."""
    with pytest.raises(ValueError, match=match):
        pair_prompts(prompts, params, SamplingParams())


def test_one_params_for_every_prompt_or_one_each():
    one, other = SamplingParams(temperature=0), SamplingParams(temperature=1)
    defaults = SamplingParams(top_k=20)
    assert pair_prompts("hi", None, defaults) == [("hi", defaults)]
    assert pair_prompts(["a", {"prompt_token_ids": [1]}], one, defaults) == [("a", one),
                                                                            ({"prompt_token_ids": [1]}, one)]
    assert pair_prompts(("a", "b"), [one, other], defaults) == [("a", one), ("b", other)]
    assert pair_prompts((p for p in "ab"), iter([one, other]), defaults) == [("a", one), ("b", other)]


def test_generation_prompt_opens_the_assistants_turn(smollm2_tokenizer):
    rendered = render_chat(smollm2_tokenizer, [QUESTION])  # the engine's prompt: text and ids (BOS not doubled)
    assert rendered["prompt"].endswith("What is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    assert rendered["prompt_token_ids"] == smollm2_tokenizer.encode(rendered["prompt"], add_special_tokens=False)
    without = render_chat(smollm2_tokenizer, [QUESTION], add_generation_prompt=False)["prompt"]
    assert without.endswith("What is 2 + 2?<|im_end|>\n")


def test_continue_final_message_leaves_the_last_message_open(smollm2_tokenizer):
    rendered = render_chat(smollm2_tokenizer, [QUESTION, STARTED_REPLY], add_generation_prompt=False,
                           continue_final_message=True)
    assert rendered["prompt"].endswith("<|im_start|>assistant\nThe answer is")


def test_continue_final_message_with_generation_prompt_raises(smollm2_tokenizer):
    with pytest.raises(ValueError, match="set only one of them"):
        render_chat(smollm2_tokenizer, [QUESTION, STARTED_REPLY], continue_final_message=True)


@pytest.fixture
def templated(smollm2_tokenizer):
    """SmolLM2's tokenizer with a template that reads a variable of its own and refuses a conversation."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = (
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ raise_exception('no system messages here') }}{% endif %}"
        "{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}{{ 'NO THINKING\n' }}{% endif %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    return tokenizer


def test_chat_template_kwargs_are_the_templates_variables(templated):
    plain = render_chat(templated, [QUESTION])["prompt"]
    assert plain == "user: What is 2 + 2?\nassistant: "
    no_thinking = render_chat(templated, [QUESTION], chat_template_kwargs={"enable_thinking": False})["prompt"]
    assert no_thinking == "user: What is 2 + 2?\nNO THINKING\nassistant: "


@pytest.mark.parametrize(("variables", "match"), [
    ({"tokenize": True}, "chat_template_kwargs may not set tokenize: not variables of the template's own"),
    ({"add_generation_prompt": False, "continue_final_message": True},
     "chat_template_kwargs may not set add_generation_prompt, continue_final_message"),
    ({"messages": []}, "chat_template_kwargs may not set messages"),
    (["enable_thinking"], "chat_template_kwargs maps the template's variables by name"),
    ([], "chat_template_kwargs maps the template's variables by name"),  # empty, still not a mapping
    ({1: True}, "chat_template_kwargs maps the template's variables by name"),
])
def test_chat_template_kwargs_that_are_not_template_variables_raise(templated, variables, match):
    with pytest.raises(ValueError, match=match):
        render_chat(templated, [QUESTION], chat_template_kwargs=variables)


def test_template_refusing_the_conversation_raises_valueerror_with_its_message(templated):
    with pytest.raises(ValueError, match="the chat template refused the conversation: no system messages here"):
        render_chat(templated, [{"role": "system", "content": "Be brief."}, QUESTION])


def test_template_variable_it_cannot_use_raises_valueerror(templated):
    system = [{"role": "system", "content": "Be brief."}]
    with pytest.raises(ValueError, match="refused the conversation: 'int' object is not callable"):  # a TypeError
        render_chat(templated, system, chat_template_kwargs={"raise_exception": 1})


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": CITY}}]


def test_tools_and_tool_calls_reach_the_template(smollm2_tokenizer):
    """A template that knows tools (as Qwen's and Llama 3.1's do) gets the request's tools, and a history's calls
    with their arguments as a mapping, and the tool messages that answer them."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = (
        "{% for tool in tools or [] %}{{ 'tool ' + tool['function']['name'] + '\n' }}{% endfor %}"
        "{% for message in messages %}{{ message['role'] + ': ' + message['content'] }}"
        "{% for call in message.get('tool_calls', []) %}"
        "{{ ' call ' + call['function']['name'] + ' ' + call['function']['arguments']['city'] }}{% endfor %}"
        "{% if message.get('tool_call_id') %}{{ ' for ' + message['tool_call_id'] }}{% endif %}"
        "{{ '\n' }}{% endfor %}"
    )
    conversation = [QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    text = render_chat(tokenizer, conversation, add_generation_prompt=False, tools=TOOLS)["prompt"]
    assert text == "tool get_weather\nuser: What is 2 + 2?\nassistant:  call get_weather Paris\ntool: sunny for c1\n"
