from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from liteinfer.config import DEFAULT_MODEL
from liteinfer.layers import FULL, SLIDING
from liteinfer.models.base import DecoderForCausalLM
from liteinfer.models.loader import (
    INDEX_FILE,
    _undo_rope_permutation,
    build_model,
    gguf_rope_scaling,
    iter_checkpoint,
    load_weights,
)
from liteinfer.models.source import ModelSource, resolve_model

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 16, 4, 2, 4


def tiny_llama_config(tied: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=32,
        hidden_size=HIDDEN,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def save_tiny_llama(directory, tied: bool, **save_kwargs) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tied))
    model.save_pretrained(directory, **save_kwargs)
    return model.state_dict()


def read_all(directory) -> dict[str, torch.Tensor]:
    source = ModelSource("tiny", directory)
    return dict(iter_checkpoint(source, tiny_llama_config(tied=False)))


@pytest.mark.parametrize("tied", [False, True])
def test_iter_checkpoint_single_file_yields_state_dict(tmp_path, tied):
    expected = save_tiny_llama(tmp_path, tied)
    if tied:  # save_pretrained stores a tied head once, as the embedding
        del expected["lm_head.weight"]

    got = read_all(tmp_path)

    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_iter_checkpoint_sharded_save_yields_state_dict(tmp_path):
    expected = save_tiny_llama(tmp_path, tied=False, max_shard_size="4KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1  # the small limit really produced shards

    got = read_all(tmp_path)

    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("index", ['{"metadata": {}}', '["model.safetensors"]', '{"weight_map": '])
def test_a_damaged_checkpoint_index_raises_naming_it(tmp_path, index):
    save_tiny_llama(tmp_path, tied=False, max_shard_size="4KB")
    (tmp_path / INDEX_FILE).write_text(index)
    with pytest.raises(ValueError, match=f"{INDEX_FILE}: not a checkpoint index"):
        read_all(tmp_path)


def test_a_directory_named_as_the_built_in_model_is_read_from_disk(tmp_path, monkeypatch):
    """As transformers and vLLM do: what is on disk comes first, a clone named like the built-in model included."""
    monkeypatch.chdir(tmp_path)
    save_tiny_llama(tmp_path / DEFAULT_MODEL, tied=False)
    assert resolve_model(DEFAULT_MODEL) == ModelSource(DEFAULT_MODEL, Path(DEFAULT_MODEL))


def test_iter_checkpoint_truncated_file_raises_naming_file(tmp_path):
    save_tiny_llama(tmp_path, tied=True)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])

    with pytest.raises(ValueError, match="model.safetensors"):
        read_all(tmp_path)


def test_undo_rope_permutation_inverts_llama_cpp_permute():
    # llama.cpp's convert_hf_to_gguf permutes each head's rows from [2, half] to [half, 2]; written out here
    # from its description so the test states what the GGUF holds.
    def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    weight, bias = torch.randn(KV_HEADS * HEAD_DIM, HIDDEN), torch.randn(KV_HEADS * HEAD_DIM)

    assert torch.equal(_undo_rope_permutation(llama_cpp_permute(weight, KV_HEADS), KV_HEADS), weight)
    assert torch.equal(_undo_rope_permutation(llama_cpp_permute(bias, KV_HEADS), KV_HEADS), bias)
    assert not torch.equal(llama_cpp_permute(weight, KV_HEADS), weight)


class PackedLinear(nn.Module):
    """A test double for a fused projection: row ranges filled shard by shard by its weight_loader."""

    def __init__(self, in_features: int, shards: dict[str | int, int]):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(sum(shards.values()), in_features), requires_grad=False)
        self.weight.weight_loader = self.load_shard
        self.rows: dict[str | int, tuple[int, int]] = {}
        start = 0
        for shard_id, size in shards.items():
            self.rows[shard_id] = (start, size)
            start += size

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: str | int) -> None:
        start, size = self.rows[shard_id]
        if tensor.shape != (size, param.shape[1]):
            raise ValueError(
                f"shard {shard_id!r}: expected {(size, param.shape[1])}, got {tuple(tensor.shape)}"
            )
        param.data[start : start + size].copy_(tensor)


class TinyModel(nn.Module):
    packed_modules_mapping = DecoderForCausalLM.packed_modules_mapping  # the mapping every real family loads with

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(8, HIDDEN)
        attn = nn.Module()
        attn.qkv_proj = PackedLinear(HIDDEN, {"q": 16, "k": 8, "v": 8})
        attn.o_proj = nn.Linear(16, HIDDEN, bias=False)
        mlp = nn.Module()
        mlp.gate_up_proj = PackedLinear(HIDDEN, {0: 12, 1: 12})
        layer = nn.Module()
        layer.self_attn, layer.mlp = attn, mlp
        self.model.layers = nn.ModuleList([layer])
        self.lm_head = nn.Linear(HIDDEN, 8, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied


def tiny_checkpoint() -> dict[str, torch.Tensor]:
    prefix = "model.layers.0."
    return {
        "model.embed_tokens.weight": torch.randn(8, HIDDEN),
        prefix + "self_attn.q_proj.weight": torch.randn(16, HIDDEN),
        prefix + "self_attn.k_proj.weight": torch.randn(8, HIDDEN),
        prefix + "self_attn.v_proj.weight": torch.randn(8, HIDDEN),
        prefix + "self_attn.o_proj.weight": torch.randn(HIDDEN, 16),
        prefix + "mlp.gate_proj.weight": torch.randn(12, HIDDEN),
        prefix + "mlp.up_proj.weight": torch.randn(12, HIDDEN),
        # Derived state some checkpoints carry (ColossalAI's the cached tables too): ignored, as vLLM does.
        prefix + "self_attn.rotary_emb.inv_freq": torch.randn(2),
        prefix + "self_attn.rotary_emb.cos_cached": torch.randn(4, 2),
        prefix + "self_attn.rotary_emb.sin_cached": torch.randn(4, 2),
    }


def test_load_weights_packed_shards_land_in_their_rows():
    model, checkpoint = TinyModel(), tiny_checkpoint()
    prefix = "model.layers.0."

    load_weights(model, checkpoint.items())

    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    qkv = [checkpoint[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(attn.qkv_proj.weight, torch.cat(qkv))
    gate_up = [checkpoint[prefix + f"mlp.{p}_proj.weight"] for p in ("gate", "up")]
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat(gate_up))
    assert torch.equal(attn.o_proj.weight, checkpoint[prefix + "self_attn.o_proj.weight"])


def test_load_weights_tied_head_ignores_checkpoint_head():
    model, checkpoint = TinyModel(), tiny_checkpoint()
    # Stored before the embedding, as in a sorted safetensors file: must not overwrite the shared Parameter.
    checkpoint = {"lm_head.weight": torch.zeros(8, HIDDEN), **checkpoint}

    load_weights(model, checkpoint.items())

    assert torch.equal(model.lm_head.weight, checkpoint["model.embed_tokens.weight"])


def test_load_weights_converts_to_parameter_dtype():
    model, checkpoint = TinyModel().to(torch.bfloat16), tiny_checkpoint()

    load_weights(model, checkpoint.items())

    embed = model.model.embed_tokens.weight
    assert embed.dtype == torch.bfloat16
    assert torch.equal(embed, checkpoint["model.embed_tokens.weight"].to(torch.bfloat16))


def test_load_weights_missing_tensor_raises_naming_parameter():
    checkpoint = tiny_checkpoint()
    del checkpoint["model.layers.0.self_attn.o_proj.weight"]

    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight"):
        load_weights(TinyModel(), checkpoint.items())


def test_load_weights_missing_shard_raises_naming_shard():
    checkpoint = tiny_checkpoint()
    del checkpoint["model.layers.0.self_attn.k_proj.weight"]

    with pytest.raises(ValueError, match=r"qkv_proj\.weight \(shards \['k'\]\)"):
        load_weights(TinyModel(), checkpoint.items())


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "model.layers.0.self_attn.v_proj.weight"])
def test_load_weights_wrong_shape_raises_naming_tensor(name):
    checkpoint = tiny_checkpoint()
    checkpoint[name] = torch.randn(3, 3)

    with pytest.raises(ValueError, match=rf"{name}.*\(3, 3\)"):
        load_weights(TinyModel(), checkpoint.items())


def test_load_weights_integer_tensor_raises_naming_it():
    # An integer tensor copied into a float parameter would load as numbers, not fail.
    checkpoint = tiny_checkpoint()
    checkpoint["model.layers.0.self_attn.o_proj.weight"] = torch.ones(HIDDEN, 16, dtype=torch.int32)

    with pytest.raises(ValueError, match=r"o_proj\.weight is torch\.int32, not floating point"):
        load_weights(TinyModel(), checkpoint.items())


def test_load_weights_integer_tensor_read_lazily_raises_naming_it(tmp_path):
    expected = save_tiny_llama(tmp_path, tied=False)
    name = "model.layers.0.mlp.down_proj.weight"
    save_file({**expected, name: expected[name].to(torch.int8)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    source = ModelSource("tiny", tmp_path)

    with pytest.raises(ValueError, match=rf"{name} is torch.int8, not floating point"):
        load_weights(LlamaForCausalLM(tiny_llama_config(tied=False)),
                     iter_checkpoint(source, tiny_llama_config(tied=False), lazy=True))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_load_weights_non_finite_value_raises_naming_parameter(value):
    checkpoint = tiny_checkpoint()
    checkpoint["model.layers.0.self_attn.k_proj.weight"][3, 1] = value

    with pytest.raises(ValueError, match=r"NaN or infinite values, loaded into: model\.layers\.0\.self_attn\.qkv_proj"):
        load_weights(TinyModel(), checkpoint.items())


def test_load_weights_unexpected_tensor_raises_naming_it():
    checkpoint = {**tiny_checkpoint(), "model.layers.0.self_attn.q_norm.weight": torch.ones(4)}

    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_norm\.weight"):
        load_weights(TinyModel(), checkpoint.items())


def test_build_model_allocates_in_dtype_and_restores_default():
    checkpoint = tiny_checkpoint()

    model = build_model(
        lambda config: TinyModel(), None, torch.bfloat16, torch.device("cpu"), checkpoint.items()
    )

    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
    assert torch.equal(model.model.embed_tokens.weight, checkpoint["model.embed_tokens.weight"].bfloat16())


def test_build_model_failure_restores_default_dtype():
    def broken(config):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        build_model(broken, None, torch.float16, torch.device("cpu"), [])
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("tied", [False, True])
def test_build_model_liteinfer_llama_from_hf_checkpoint_matches(tmp_path, tied):
    from liteinfer.models import get_model_class

    expected = save_tiny_llama(tmp_path, tied)
    config = tiny_llama_config(tied)
    checkpoint = iter_checkpoint(ModelSource("tiny", tmp_path), config)

    model = build_model(
        get_model_class(["LlamaForCausalLM"]), config, torch.float32, torch.device("cpu"), checkpoint
    )

    params = dict(model.named_parameters(remove_duplicate=False))
    attn = "model.layers.1.self_attn."
    qkv = [expected[attn + f"{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(params[attn + "qkv_proj.weight"], torch.cat(qkv))
    assert torch.equal(params["lm_head.weight"], expected["lm_head.weight"])
    assert (params["lm_head.weight"] is params["model.embed_tokens.weight"]) == tied


def rope_metadata_gguf(path: Path, arch: str, **scaling) -> gguf.GGUFReader:
    """A GGUF holding rope scaling metadata only (what `gguf_rope_scaling` reads)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_rope_scaling_type(gguf.RopeScalingType(scaling["kind"]))
    writer.add_rope_scaling_factor(scaling["factor"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(path)


def test_gguf_rope_scaling_of_a_model_whose_layer_types_rotate_apart_is_the_full_attention_layers(tmp_path):
    """Gemma 3's GGUFs: linear x8 in metadata, which llama.cpp applies to the global (full-attention) layers only."""
    config = Gemma3TextConfig(num_hidden_layers=2, layer_types=[SLIDING, FULL])
    local = dict(config.rope_parameters[SLIDING])
    gguf_rope_scaling(rope_metadata_gguf(tmp_path / "g.gguf", "gemma3", kind="linear", factor=8.0), config)
    assert config.rope_parameters[SLIDING] == local
    assert config.rope_parameters[FULL]["rope_type"] == "linear" and config.rope_parameters[FULL]["factor"] == 8.0
    assert "rope_theta" in config.rope_parameters[FULL]


def test_gguf_rope_scaling_of_an_unknown_kind_is_refused(tmp_path):
    reader = rope_metadata_gguf(tmp_path / "l.gguf", "llama", kind="longrope", factor=2.0)  # with no factor tensors
    with pytest.raises(ValueError, match="rope scaling 'longrope' is not supported"):
        gguf_rope_scaling(reader, LlamaConfig())
