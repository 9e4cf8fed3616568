import pytest

from liteinfer.sampling import RequestOutputKind, SamplingParams, StructuredOutputsParams


def test_sampling_params_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (None, 16, 0, None)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.logit_bias is None and p.allowed_token_ids is None and p.bad_words == []
    assert not p.include_stop_str_in_output and not p.ignore_eos and p.skip_special_tokens
    assert not p.is_greedy and p.output_kind is RequestOutputKind.CUMULATIVE


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logprobs": -2}, "logprobs"),  # -1: the whole vocabulary, as vLLM
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"n": "2"}, "n"),
        ({"n": 2.0}, "n"),
        ({"n": True}, "n"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"seed": 1.5}, "seed"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"output_kind": "final"}, "output_kind"),
        ({"logit_bias": [1.0]}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),  # token ids are ints here; the server turns its strings into ints
        ({"logit_bias": {5: float("inf")}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, 2.0]}, "allowed_token_ids"),
        ({"allowed_token_ids": 3}, "allowed_token_ids"),
        ({"bad_words": [3]}, "bad_words"),
        ({"bad_words": ["ok", " "]}, "bad_words"),
        ({"bad_words": ["bad \ud800"]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ],
)
def test_sampling_params_invalid_value_raises_value_error_naming_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


def test_sampling_params_boundary_values_are_accepted():
    p = SamplingParams(temperature=0, top_p=1, top_k=-1, min_p=1, max_tokens=None, min_tokens=100)
    assert p.is_greedy
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams(presence_penalty=-2, frequency_penalty=2, logprobs=0).logprobs == 0


def test_sampling_params_stop_string_normalised_to_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(7, 8)).stop_token_ids == [7, 8]


def test_sampling_params_logit_edits_normalised():
    p = SamplingParams(logit_bias={5: 2, 7: -1.5}, allowed_token_ids=(3, 1), bad_words="dog")
    assert p.logit_bias == {5: 2.0, 7: -1.5} and all(isinstance(v, float) for v in p.logit_bias.values())
    assert p.allowed_token_ids == [3, 1] and p.bad_words == ["dog"]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"json": {"type": "object"}, "regex": "[0-9]+"},
        {"json": "{not json"},
        {"json": ["a list"]},
        {"choice": []},
        {"choice": ["a", 1]},
        {"regex": 5},
        {"json_object": "yes"},
    ],
)
def test_structured_outputs_take_exactly_one_well_formed_format(options):
    with pytest.raises(ValueError, match=r"^structured_outputs "):
        StructuredOutputsParams(**options)


def test_structured_outputs_json_text_is_parsed_and_params_hold_it():
    spec = StructuredOutputsParams(json='{"type": "integer"}')
    assert spec.json == {"type": "integer"}
    assert SamplingParams(structured_outputs=spec).structured_outputs is spec
    with pytest.raises(ValueError, match=r"^structured_outputs must be None or a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {"type": "integer"}})
