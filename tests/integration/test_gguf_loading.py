"""The real SmolLM2 GGUF: our dequantization, name mapping and un-permutation against transformers' own
loader, and the GGUF -> safetensors conversion cache.

Each GGUF parse takes seconds, so module fixtures share them.
"""

import pytest
import torch
from conftest import smollm2_gguf_path
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from liteinfer.models import get_model_class
from liteinfer.models.loader import build_model, iter_checkpoint
from liteinfer.models.source import ModelSource, load_config, load_tokenizer, resolve_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_source() -> ModelSource:
    path = smollm2_gguf_path()
    return ModelSource("SmolLM2-135M-Instruct", path.parent, path.name)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[ModelSource, ModelSource]:
    """(first, second) resolution of the built-in model, starting from an empty conversion cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LITEINFER_CACHE", str(tmp_path_factory.mktemp("liteinfer-cache")))
        return resolve_model("SmolLM2-135M-Instruct"), resolve_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def config(converted):
    """The config as converted (JSON, fast); checked against the GGUF metadata below."""
    return load_config(converted[0])


@pytest.fixture(scope="module")
def gguf_tensors(gguf_source, config) -> dict[str, torch.Tensor]:
    return dict(iter_checkpoint(gguf_source, config))


@pytest.fixture(scope="module")
def reference(gguf_source, config) -> dict:
    """transformers' own reading of the GGUF: {"config": {...}, "tensors": {name: tensor}, ...}.

    This is its dequantize-everything reader (from_pretrained would also need `accelerate`, and keeps
    quantized weights packed); it maps names against a model, here one on the meta device.
    """
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(
        gguf_source.path / gguf_source.gguf_file, return_tensors=True, model_to_load=skeleton
    )


def test_iter_checkpoint_gguf_matches_transformers_gguf_loader(gguf_tensors, reference):
    expected = reference["tensors"]

    # The GGUF has no output.weight: the head is tied to the embedding.
    assert "lm_head.weight" not in expected
    assert gguf_tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        assert gguf_tensors[name].dtype == torch.float32, name
        assert torch.equal(gguf_tensors[name], tensor.float()), name


def test_resolve_gguf_second_time_returns_cached_safetensors_dir(converted):
    first, second = converted

    assert first == second
    assert first.gguf_file is None
    assert (first.path / "config.json").is_file()
    assert (first.path / "model.safetensors.index.json").is_file()


def test_converted_weights_equal_gguf_tensors(converted, config, gguf_tensors):
    from_cache = dict(iter_checkpoint(converted[1], config))

    assert from_cache.keys() == gguf_tensors.keys()
    for name, tensor in gguf_tensors.items():
        assert torch.equal(from_cache[name], tensor), name


def test_converted_config_and_tokenizer_equal_gguf_ones(converted, config, reference, smollm2_tokenizer):
    tokenizer = load_tokenizer(converted[0])
    messages = [{"role": "user", "content": "Héllo, wörld! 123 <|im_end|>"}]

    assert config.architectures == ["LlamaForCausalLM"]
    for key in (
        "hidden_size",
        "num_key_value_heads",
        "num_hidden_layers",
        "rms_norm_eps",
        "tie_word_embeddings",
    ):
        assert getattr(config, key) == reference["config"][key], key
    assert config.rope_parameters["rope_theta"] == reference["config"]["rope_theta"]
    assert tokenizer.apply_chat_template(messages) == smollm2_tokenizer.apply_chat_template(messages)
    assert tokenizer.eos_token == smollm2_tokenizer.eos_token
    assert tokenizer.chat_template == smollm2_tokenizer.chat_template


def test_build_model_from_converted_cache_fills_every_parameter(converted, config, gguf_tensors):
    checkpoint = iter_checkpoint(converted[0], config)

    model = build_model(
        get_model_class(config.architectures), config, torch.bfloat16, torch.device("cpu"), checkpoint
    )

    params = dict(model.named_parameters())
    attn = "model.layers.29.self_attn."
    qkv = torch.cat([gguf_tensors[attn + f"{p}_proj.weight"] for p in "qkv"]).bfloat16()
    assert torch.equal(params[attn + "qkv_proj.weight"], qkv)
    assert model.lm_head.weight is model.model.embed_tokens.weight
