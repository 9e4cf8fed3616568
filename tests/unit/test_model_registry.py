"""The architecture registry, the config checks of the shared decoder, fused checkpoint tensors and long-rope's
choice of factors."""

import math

import pytest
import torch
from transformers import LlamaConfig

from liteinfer.entrypoints.cli import main
from liteinfer.layers import FULL, PackedLinear, RotaryEmbedding
from liteinfer.layers.rotary import positions_served
from liteinfer.models import get_model_class, supported_architectures
from liteinfer.models.loader import load_weights

FAMILIES = [
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
]


def test_supported_architectures_lists_every_family():
    assert supported_architectures() == FAMILIES
    assert [get_model_class(["SomethingElse", name]).__name__ for name in FAMILIES] == FAMILIES


def test_unsupported_architecture_error_names_the_supported_ones():
    with pytest.raises(ValueError, match="MambaForCausalLM") as error:
        get_model_class(["MambaForCausalLM"])
    assert all(name in str(error.value) for name in FAMILIES)


def test_cli_models_lists_every_family(capsys):
    assert main(["models"]) == 0
    assert capsys.readouterr().out.splitlines() == FAMILIES


def tiny_config(**options) -> LlamaConfig:
    options = {"vocab_size": 16, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
               "num_attention_heads": 2, "max_position_embeddings": 32, **options}
    return LlamaConfig(**options)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"hidden_act": "relu"}, "hidden_act 'relu'"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
         "rope scaling type 'dynamic'"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"layer_types": [FULL, "chunked_attention"]}, "chunked_attention"),
    ],
)
def test_unsupported_config_features_raise_valueerror_naming_them(options, match):
    config = tiny_config(**options)
    with torch.device("meta"), pytest.raises(ValueError, match=match):
        get_model_class(["LlamaForCausalLM"])(config)


def test_load_weights_takes_a_fused_checkpoint_tensor_whole():
    model = torch.nn.Module()
    model.qkv_proj = PackedLinear(4, {"q": 4, "k": 2, "v": 2})
    model.packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k")}
    fused = torch.randn(8, 4)
    load_weights(model, [("qkv_proj.weight", fused)])
    assert torch.equal(model.qkv_proj.weight, fused)
    with pytest.raises(ValueError, match=r"qkv_proj\.weight: fused tensor: expected shape \(8, 4\), got \(6, 4\)"):
        load_weights(model, [("qkv_proj.weight", torch.randn(6, 4))])


def longrope(max_position: int) -> RotaryEmbedding:
    scaling = {"rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [3.0, 5.0],
               "original_max_position_embeddings": 16, "factor": 4.0}
    return RotaryEmbedding(4, max_position, 10000.0, scaling)


def test_longrope_picks_short_factors_within_the_original_context_and_long_ones_past_it():
    """A position's angle is position / (factor * theta^(2i/d)); cos and sin are scaled by the attention factor,
    which the model's extension sets (4x here), whatever context is served: 16 positions (the original context)
    take the short factors, 64 the long ones."""
    short, long = longrope(16), longrope(64)
    cos_short, _ = short(torch.tensor([5]), torch.float32)
    cos_long, _ = long(torch.tensor([5]), torch.float32)
    inv = torch.tensor([1.0, 10000.0**-0.5])
    scale = math.sqrt(1 + math.log(64 / 16) / math.log(16))
    torch.testing.assert_close(cos_short[0, 0, :2], torch.cos(5 * inv / torch.tensor([1.0, 2.0])) * scale)
    torch.testing.assert_close(cos_long[0, 0, :2], torch.cos(5 * inv / torch.tensor([3.0, 5.0])) * scale)


@pytest.mark.parametrize(
    ("rope", "served"),
    [
        (None, 32),
        ({"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}, 32),  # Hub configs store the extended length
        ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}, 64),
        ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}, 256),
    ],
)
def test_positions_served_are_the_configs_or_what_yarn_was_made_for(rope, served):
    """As vLLM: YaRN serves original_max_position_embeddings x factor positions (Qwen's model cards add YaRN to a
    config whose max_position_embeddings is the original context); other ropes max_position_embeddings."""
    config = tiny_config(**({"rope_parameters": rope} if rope else {}))
    assert positions_served(config) == served


def test_yarn_keeps_fast_pairs_and_interpolates_slow_ones():
    """Over an original context of 64 positions at theta 100, head_dim 8's pairs turn about 10, 3.2, 1.02 and 0.32
    times: with beta_fast 4 and beta_slow 1, pair 0 keeps its frequency, pair 3 is divided by factor, pairs 1 and 2
    lie on the ramp between; cos and sin are scaled by 0.1 ln(factor) + 1."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 4.0,
               "beta_slow": 1.0, "truncate": False}
    rotary = RotaryEmbedding(8, 64, 100.0, scaling)
    cos, _ = rotary(torch.tensor([3]), torch.float32)
    inv = 100.0 ** -(torch.arange(4) / 4)
    low, high = (8 * math.log(64 / (turns * 2 * math.pi)) / (2 * math.log(100.0)) for turns in (4.0, 1.0))
    ramp = ((torch.arange(4) - low) / (high - low)).clamp(0, 1)
    assert ramp[0] == 0 and 0 < ramp[1] < ramp[2] < 1 and ramp[3] == 1
    expected = torch.cos(3 * (inv * (1 - ramp) + inv / 4.0 * ramp)) * (0.1 * math.log(4.0) + 1)
    torch.testing.assert_close(cos[0, 0, :4], expected)
