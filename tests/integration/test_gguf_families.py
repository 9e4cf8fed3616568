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

from liteinfer import LLM, SamplingParams
from liteinfer.layers.rotary import positions_served
from liteinfer.models.source import ModelSource, load_config, resolve_model

VOCAB = 512
# Only what GGUF metadata can say: transformers reads no sliding window for these. Rope scaling as llama.cpp's
# converter stores it: linear and YaRN in metadata, Llama 3's and long-rope's per-pair divisors as tensors.
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [1.0 + 0.5 * i for i in range(8)]}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
GGUF_VARIANTS = {
    "qwen2": Variant("Qwen2ForCausalLM", "Qwen2Config", dict(vocab_size=VOCAB, tie_word_embeddings=True)),
    "phi3": Variant("Phi3ForCausalLM", "Phi3Config", dict(vocab_size=VOCAB, tie_word_embeddings=False)),
    "qwen2-yarn": Variant("Qwen2ForCausalLM", "Qwen2Config", dict(
        vocab_size=VOCAB, tie_word_embeddings=True, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})),
    "llama-linear": Variant("LlamaForCausalLM", "LlamaConfig", dict(
        vocab_size=VOCAB, tie_word_embeddings=True, rope_parameters={
            "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    "llama3": Variant("LlamaForCausalLM", "LlamaConfig", dict(vocab_size=VOCAB, tie_word_embeddings=False,
                                                             rope_parameters=LLAMA3)),
    "phi3-long": Variant("Phi3ForCausalLM", "Phi3Config", dict(
        vocab_size=VOCAB, tie_word_embeddings=False, original_max_position_embeddings=32, rope_parameters=LONGROPE)),
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


def llama_cpp_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """How llama.cpp's converter lays out Llama's q/k rows (each head's rotated halves interleaved)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def add_rope_scaling(writer: gguf.GGUFWriter, hf_model) -> None:
    """The model's rope scaling as llama.cpp's converter writes it."""
    config = hf_model.config
    scaling = config.rope_parameters
    kind = scaling.get("rope_type", "default")
    if kind in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
        writer.add_rope_scaling_factor(scaling["factor"])
    if kind == "yarn":
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    if kind == "llama3":  # the divisor of each rotated pair's frequency
        rotary = hf_model.model.rotary_emb
        plain = 1.0 / scaling["rope_theta"] ** (torch.arange(0, rotary.inv_freq.numel() * 2, 2).float()
                                                / (rotary.inv_freq.numel() * 2))
        writer.add_tensor("rope_freqs.weight", (plain / rotary.inv_freq).float().numpy())
    if kind == "longrope":
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_tensor("rope_factors_long.weight", torch.tensor(scaling["long_factor"]).numpy())
        writer.add_tensor("rope_factors_short.weight", torch.tensor(scaling["short_factor"]).numpy())


def write_gguf(path, hf_model, arch: str, tokenizer, end_of_turn: int | None = None) -> None:
    """The model's float32 tensors under their GGUF names, its hyperparameters and a tokenizer (and an end-of-turn
    token, as Llama 3's GGUFs name <|eot_id|>)."""
    config = hf_model.config
    writer = gguf.GGUFWriter(path, arch)
    if end_of_turn is not None:
        writer.add_eot_token_id(end_of_turn)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    add_tokenizer(writer, tokenizer)
    add_rope_scaling(writer, hf_model)
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # as llama.cpp does: no output.weight means a tied head
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            tensor = llama_cpp_permute(tensor, config.num_attention_heads if ".q_proj." in name
                                       else config.num_key_value_heads)
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
    arch = {"Qwen2ForCausalLM": "qwen2", "Phi3ForCausalLM": "phi3", "LlamaForCausalLM": "llama"}
    write_gguf(path, hf_model, arch[GGUF_VARIANTS[request.param].architecture], smollm2_tokenizer)
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
    assert positions_served(ours) == positions_served(theirs)


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


def test_gguf_end_of_turn_token_ends_generation_as_eos_does(tmp_path, smollm2_tokenizer):
    """llama.cpp stops on a GGUF's EOS, end-of-turn and end-of-message tokens; transformers' GGUF reading keeps EOS
    only, so the conversion names the others in generation_config.json."""
    hf_model = make_tiny_model(tmp_path, smollm2_tokenizer, GGUF_VARIANTS["qwen2"])
    prompt = {"prompt_token_ids": [300, 301, 302]}
    greedy = SamplingParams(temperature=0, max_tokens=8)
    first = LLM(str(tmp_path), dtype="float32", num_kv_blocks=16).generate(prompt, greedy)[0].outputs[0].token_ids[0]
    assert first != smollm2_tokenizer.eos_token_id
    path = tmp_path / "eot.gguf"
    write_gguf(path, hf_model, "qwen2", smollm2_tokenizer, end_of_turn=first)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=16)
    assert llm.engine.eos_token_ids == {smollm2_tokenizer.eos_token_id, first}
    out = llm.generate(prompt, greedy)[0].outputs[0]
    assert out.token_ids == [first] and (out.finish_reason, out.stop_reason) == ("stop", first)
