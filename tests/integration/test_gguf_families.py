"""GGUF files of other families, written here with the `gguf` package the way llama.cpp's converter lays them
out, against their safetensors twins: the same weights, the same config, the same greedy tokens.

Qwen2 stores q/k/v (with their biases) and gate/up as separate tensors; Phi-3 keeps its fused qkv_proj and
gate_up_proj. The vocabulary is SmolLM2's first VOCAB tokens and the merges among them (a GPT-2 style BPE, as
Qwen's is): parsing GGUF tokenizer metadata is slow in Python, and 49k tokens would take seconds per file.
"""

import json

import gguf
import pytest
import torch
from parity import GREEDY, Variant, make_tiny_model, one_torch_thread  # noqa: F401 - an autouse fixture
from safetensors.torch import load_file

from liteinfer import LLM
from liteinfer.models.source import ModelSource, load_config, resolve_model

VOCAB = 512
# Only what GGUF metadata can say: transformers reads no sliding window or long-rope factors for these.
GGUF_VARIANTS = {
    "qwen2": Variant("Qwen2ForCausalLM", "Qwen2Config", dict(vocab_size=VOCAB, tie_word_embeddings=True)),
    "phi3": Variant("Phi3ForCausalLM", "Phi3Config", dict(vocab_size=VOCAB, tie_word_embeddings=False)),
}
PROMPT_LENGTHS = [1, 5, 27, 47]


@pytest.fixture(scope="module", autouse=True)
def _conversion_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LITEINFER_CACHE", str(tmp_path_factory.mktemp("liteinfer-cache")))
        yield


def add_tokenizer(writer: gguf.GGUFWriter, tokenizer) -> None:
    """SmolLM2's vocabulary cut to its first VOCAB tokens, with the merges that build only those."""
    bpe = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(bpe["vocab"], key=bpe["vocab"].get)[:VOCAB]
    kept = set(tokens)
    merges = [" ".join(pair) for pair in bpe["merges"] if "".join(pair) in kept]
    special = set(tokenizer.added_tokens_decoder)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)


def write_gguf(path, hf_model, arch: str, tokenizer) -> None:
    """The model's float32 tensors under their GGUF names, its hyperparameters and a tokenizer."""
    config = hf_model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    add_tokenizer(writer, tokenizer)
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # as llama.cpp does: no output.weight means a tied head
        writer.add_tensor(table.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=list(GGUF_VARIANTS))
def twins(request, tmp_path_factory, smollm2_tokenizer):
    """(model directory, GGUF file) holding the same random weights."""
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf_model = make_tiny_model(directory, smollm2_tokenizer, GGUF_VARIANTS[request.param])
    path = directory / f"tiny-{request.param}.gguf"
    write_gguf(path, hf_model, request.param, smollm2_tokenizer)
    return directory, path


def test_gguf_twin_converts_to_the_same_tensors_and_config(twins):
    directory, path = twins
    converted = resolve_model(str(path))
    expected = load_file(directory / "model.safetensors")
    got = {}
    for file in converted.path.glob("*.safetensors"):
        got.update(load_file(file))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    ours, theirs = load_config(converted), load_config(ModelSource("twin", directory))
    assert ours.architectures == theirs.architectures
    for key in ("vocab_size", "hidden_size", "num_key_value_heads", "num_hidden_layers", "tie_word_embeddings"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)  # stored as float32


def test_gguf_twin_generates_the_same_greedy_tokens(twins):
    directory, path = twins
    from_gguf = LLM(str(path), dtype="float32", num_kv_blocks=64)
    from_safetensors = LLM(str(directory), dtype="float32", num_kv_blocks=64)
    assert type(from_gguf.engine.runner.model) is type(from_safetensors.engine.runner.model)
    generator = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(17, VOCAB, (n,), generator=generator).tolist()}
               for n in PROMPT_LENGTHS]
    ours, theirs = from_gguf.generate(prompts, GREEDY), from_safetensors.generate(prompts, GREEDY)
    for prompt, a, b in zip(prompts, ours, theirs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, prompt
