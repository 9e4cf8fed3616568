"""Reading checkpoints and streaming their tensors into a model's already-allocated parameters.

A checkpoint is an iterator of (Hugging Face tensor name, tensor), produced one tensor at a time, so loading
holds at most the model plus one tensor in memory, whether it comes from safetensors or a dequantized GGUF.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import PretrainedConfig

from liteinfer.distributed import TensorParallelGroup
from liteinfer.layers import FULL

if TYPE_CHECKING:
    from liteinfer.models.source import ModelSource

INDEX_FILE = "model.safetensors.index.json"
# Derived state that some older checkpoints saved (ColossalAI's the rotary tables too); our layers compute it.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# GGUF architectures whose q/k rows llama.cpp's converter permutes for its interleaved rope (Mistral is
# stored as "llama" too); other architectures keep the Hugging Face row order.
_ROPE_PERMUTED_ARCHS = {"llama"}
# GGUF architectures whose norm weights llama.cpp's converter stores as 1 + w (Gemma's norms scale by 1 + w).
_NORM_PLUS_ONE_ARCHS = {"gemma2", "gemma3"}
# GGUF architectures that keep the checkpoint's fused projections (qkv_proj, gate_up_proj) fused.
_FUSED_PROJECTION_ARCHS = {"phi3"}
# Rope scaling that llama.cpp's converter stores as tensors: each rotated pair's frequency divisor (Llama 3's rule
# applied), long-rope's two sets of them. `gguf_rope_scaling` reads them into the config; they are no weights.
_ROPE_TENSORS = {gguf.TENSOR_NAMES[kind] + ".weight": kind for kind in (
    gguf.MODEL_TENSOR.ROPE_FREQS, gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)}

Checkpoint = Iterable[tuple[str, "torch.Tensor | LazyTensor"]]  # see iter_checkpoint


def safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint files of a model directory: the shards its index names, or else every *.safetensors."""
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory}: no config.json, so this is not a model directory")
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # not JSON, or not an index's shape
            raise ValueError(f"{index}: not a checkpoint index, a JSON object whose weight_map maps each tensor to "
                             f"its file ({type(e).__name__}: {e})") from e
        missing = [name for name in shards if not (directory / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{directory}: shards listed in {INDEX_FILE} are missing: {missing}")
        return [directory / name for name in shards]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights (the only checkpoint format read)")
    return files


def iter_checkpoint(
    source: ModelSource, config: PretrainedConfig, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """Yield (Hugging Face name, tensor) one at a time; GGUF tensors come dequantized to float32.

    With `lazy`, safetensors tensors come as `LazyTensor`s, read only as far as the weight loaders slice them
    (what tensor-parallel ranks load through); a GGUF file is dequantized whole either way, but the engine only
    meets GGUF files converted to safetensors (models/source.py).
    """
    if source.gguf_file is not None:
        return gguf_tensors(read_gguf(source.path / source.gguf_file), config)
    return _iter_safetensors(safetensors_files(source.path), lazy)


class LazyTensor:
    """A checkpoint tensor not read yet: `shape`, `dtype`, and `narrow` / `[...]` read only what they select.

    The parameters' weight loaders take a slice (a tensor-parallel rank's rows or columns) through the same
    `narrow` a `torch.Tensor` has, so a rank never holds more of a tensor than its own share."""

    def __init__(self, tensor_slice):  # a safetensors slice (safe_open(...).get_slice(name))
        self._slice = tensor_slice
        self.shape = torch.Size(tensor_slice.get_shape())
        # An empty slice reads nothing and carries the dtype in torch's terms (a scalar is read whole).
        self.dtype = (tensor_slice[:0] if self.shape else tensor_slice[...]).dtype

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def __getitem__(self, index) -> torch.Tensor:
        return self._slice[index]


def _iter_safetensors(files: list[Path], lazy: bool) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    for file in files:
        try:
            # safe_open memory-maps the file: a tensor is read only when asked for.
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                    yield name, LazyTensor(f.get_slice(name)) if lazy else f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from e


def read_gguf(file: Path) -> gguf.GGUFReader:
    """gguf's reader over `file`; a damaged file fails it in many ways (IndexError, numpy's reshape, ...): one clear
    error instead."""
    try:
        return gguf.GGUFReader(file)
    except Exception as e:
        raise ValueError(f"{file}: not a GGUF file that can be read (truncated, corrupt or of an unknown version): "
                         f"{type(e).__name__}: {e}") from e


def gguf_tensors(reader: gguf.GGUFReader, config: PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
    file = reader.data.filename  # the memory map's path
    arch = reader.fields["general.architecture"].contents()
    hf_names = _gguf_to_hf_names(arch, config)
    for tensor in reader.tensors:
        if tensor.name in _ROPE_TENSORS:
            continue
        name = hf_names.get(tensor.name)
        if name is None:
            raise ValueError(f"{file}: GGUF tensor {tensor.name} has no Hugging Face name for {arch!r}")
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # F32 tensors come back as read-only views of the memory-mapped file; torch wants writable memory.
        weights = torch.from_numpy(weights if weights.flags.writeable else weights.copy())
        if arch in _ROPE_PERMUTED_ARCHS and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            weights = _undo_rope_permutation(weights, heads)
        if arch in _NORM_PLUS_ONE_ARCHS and name.endswith("norm.weight"):
            weights = weights - 1
        yield name, weights


def gguf_rope_scaling(reader: gguf.GGUFReader, config: PretrainedConfig) -> None:
    """Sets `config`'s rope scaling as llama.cpp's converter stored it, which transformers' GGUF reading leaves out:
    linear and YaRN in metadata, Llama 3's per-pair divisors (`rope_freqs`) and long-rope's (`rope_factors_long` and
    `_short`) as tensors. Divisors alone take long-rope's form with one set for any context and no attention scale.
    Where layer types rotate each their own way (Gemma 3), the scaling is the full-attention layers', as llama.cpp
    applies it."""
    arch = reader.fields["general.architecture"].contents()

    def meta(key: str) -> Any:
        field = reader.fields.get(key.format(arch=arch))
        return None if field is None else field.contents()

    divisors = {_ROPE_TENSORS[t.name]: gguf.quants.dequantize(t.data, t.tensor_type).tolist()
                for t in reader.tensors if t.name in _ROPE_TENSORS}
    kind = meta(gguf.Keys.Rope.SCALING_TYPE) or "none"
    factor = meta(gguf.Keys.Rope.SCALING_FACTOR)
    original = meta(gguf.Keys.Rope.SCALING_ORIG_CTX_LEN)
    if gguf.MODEL_TENSOR.ROPE_FACTORS_LONG in divisors:
        scaling = {"rope_type": "longrope", "long_factor": divisors[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG],
                   "short_factor": divisors[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT],
                   "original_max_position_embeddings": original}
    elif gguf.MODEL_TENSOR.ROPE_FREQS in divisors:
        pairs = divisors[gguf.MODEL_TENSOR.ROPE_FREQS]
        scaling = {"rope_type": "longrope", "long_factor": pairs, "short_factor": pairs, "attention_factor": 1.0,
                   "original_max_position_embeddings": config.max_position_embeddings}
    elif kind == "linear":
        scaling = {"rope_type": "linear", "factor": factor}
    elif kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
                   "beta_fast": meta(gguf.Keys.Rope.SCALING_YARN_BETA_FAST),
                   "beta_slow": meta(gguf.Keys.Rope.SCALING_YARN_BETA_SLOW)}
    elif kind == "none":
        return
    else:
        raise ValueError(f"{reader.data.filename}: rope scaling {kind!r} is not supported")
    scaling = {key: value for key, value in scaling.items() if value is not None}
    params = getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", 10000.0)}
    config.rope_parameters = {**params, FULL: {**params[FULL], **scaling}} if FULL in params else {**params, **scaling}
    if "original_max_position_embeddings" in scaling and hasattr(config, "original_max_position_embeddings"):
        # Phi-3's config holds it too, and transformers takes that one over the dict's.
        config.original_max_position_embeddings = scaling["original_max_position_embeddings"]


def _gguf_to_hf_names(arch: str, config: PretrainedConfig) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, by inverting gguf's own HF -> GGUF table.

    gguf's table knows many historical spellings of each tensor; our model's own parameter names (with packed
    projections unpacked into their checkpoint names) say which spelling is the Hugging Face one.
    """
    model_arch = next((key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch), None)
    if model_arch is None:
        raise ValueError(f"GGUF architecture {arch!r} is unknown to the gguf package")
    table = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    names = {}
    for hf_name in _checkpoint_names(config, unpack=arch not in _FUSED_PROJECTION_ARCHS):
        gguf_name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            names[gguf_name] = hf_name
    return names


def _checkpoint_names(config: PretrainedConfig, unpack: bool = True) -> list[str]:
    """The checkpoint tensor names our model for `config` loads, from a skeleton on the meta device (no memory):
    packed parameters under the names of the tensors they pack, or with `unpack=False` under their own."""
    from liteinfer.models import get_model_class  # the registry imports the model files, which import layers

    model_cls = get_model_class(config.architectures)
    with torch.device("meta"):
        skeleton = model_cls(config)
    packed = getattr(model_cls, "packed_modules_mapping", {}) if unpack else {}
    unpacked: dict[str, list[str]] = {}  # packed parameter -> the checkpoint tensors it holds
    for checkpoint_name, (target, _) in packed.items():
        unpacked.setdefault(target, []).append(checkpoint_name)
    names = []
    for name in skeleton.state_dict():
        parts = name.split(".")
        i = next((i for i, part in enumerate(parts) if part in unpacked), None)
        if i is None:
            names.append(name)
        else:
            names += [".".join([*parts[:i], shard, *parts[i + 1 :]]) for shard in unpacked[parts[i]]]
    return names


def _undo_rope_permutation(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """Back from llama.cpp's interleaved rope layout to the Hugging Face "rotate half" one.

    Within each head, HF keeps the rotated pairs as (first half, second half) of the rows; llama.cpp's
    converter interleaves them as (row i of the first half, row i of the second half): it views each head's
    rows as [2, half] and transposes to [half, 2]. Transposing back restores the original order.
    """
    shape = weights.shape
    half = shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *shape[1:]).transpose(1, 2).reshape(shape)


@torch.no_grad()
def load_weights(model: nn.Module, checkpoint: Checkpoint) -> None:
    """Copy every checkpoint tensor into its parameter, converting dtype and device on the way.

    Packed parameters (see `packed_modules_mapping`) receive one shard per checkpoint tensor through the
    parameter's `weight_loader`, or the whole packed tensor where the checkpoint stores it fused (Phi-3). Raises
    ValueError for tensors the model has no place for, tensors that are not floating point, shape mismatches,
    parameters (or shards) the checkpoint never provided, and NaN or infinite values.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    packed: dict[str, tuple[str, str | int]] = getattr(model, "packed_modules_mapping", {})
    # A tied head is the embedding's own Parameter: the embedding fills it, and a saved copy of the head is
    # redundant (and may be stored first, since safetensors sorts names).
    head, embedding = params.get("lm_head.weight"), params.get("model.embed_tokens.weight")
    tied_head = head is not None and head is embedding
    loaded: dict[int, set[str | int | None]] = {}  # id(param) -> shards loaded (None: the whole tensor)

    for name, tensor in checkpoint:
        if name.endswith(_IGNORED_SUFFIXES) or (tied_head and name == "lm_head.weight"):
            continue
        param_name, shard_id = _packed_target(name, packed)
        param = params.get(param_name)
        if param is None:
            raise ValueError(f"checkpoint tensor {name} has no matching parameter in {type(model).__name__}")
        if not tensor.dtype.is_floating_point:
            # Copied into a float parameter an integer tensor would load as numbers, not fail: weights stored in a
            # form this model does not read (an integer-quantized checkpoint's, or damaged ones).
            raise ValueError(f"checkpoint tensor {name} is {tensor.dtype}, not floating point: "
                             f"{type(model).__name__} reads float weights")
        weight_loader = getattr(param, "weight_loader", _copy_whole)
        try:
            if shard_id is None:
                weight_loader(param, tensor)
            else:
                weight_loader(param, tensor, shard_id)
        except ValueError as e:
            where = name if param_name == name else f"{name} (into {param_name})"
            raise ValueError(f"checkpoint tensor {where}: {e}") from e
        loaded.setdefault(id(param), set()).add(shard_id)

    missing = []
    for name, param in model.named_parameters():
        got = loaded.get(id(param), set())
        absent = set() if None in got else _expected_shards(name, packed) - got
        if absent == {None}:
            missing.append(name)
        elif absent:
            missing.append(f"{name} (shards {sorted(absent, key=str)})")
    if missing:
        raise ValueError(f"checkpoint is missing tensors for parameters: {', '.join(missing)}")
    # A NaN or infinite weight would not fail anywhere later: every logit turns NaN and sampling picks token 0.
    damaged = [name for name, param in model.named_parameters() if not _finite(param)]
    if damaged:
        raise ValueError(f"checkpoint holds NaN or infinite values, loaded into: {', '.join(damaged)}")


def _finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in `tensor`: its smallest and largest elements are finite (both are NaN where any element
    is). Faster than `isfinite(tensor).all()`, which writes a mask: SmolLM2's fp32 weights in 29 ms against 370."""
    return all(torch.isfinite(extreme) for extreme in torch.aminmax(tensor))


def _packed_target(name: str, packed: dict[str, tuple[str, str | int]]) -> tuple[str, str | int | None]:
    """Checkpoint name -> (parameter name, shard id).

    E.g. "model.layers.0.self_attn.k_proj.weight" -> ("model.layers.0.self_attn.qkv_proj.weight", "k").
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            parts[i], shard_id = packed[part]
            return ".".join(parts), shard_id
    return name, None


def _expected_shards(param_name: str, packed: dict[str, tuple[str, str | int]]) -> set[str | int | None]:
    modules = set(param_name.split("."))
    shards = {shard_id for target, shard_id in packed.values() if target in modules}
    return shards or {None}


def _copy_whole(param: nn.Parameter, tensor: torch.Tensor | LazyTensor) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
    param.data.copy_(tensor[...])


def build_model(
    model_cls: type[nn.Module],
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    checkpoint: Checkpoint,
    tp: TensorParallelGroup | None = None,
    max_model_len: int | None = None,
) -> nn.Module:
    """Allocate the model (this tensor-parallel rank's shard of it, serving `max_model_len` positions if given)
    directly on `device` in `dtype`, then stream the checkpoint into it.

    Parameters are created empty where they will live, so there is never a second full copy of the weights
    (no CPU staging copy, no float32 copy of a bfloat16 model), and a rank reads only its slices.
    """
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            given = {name: value for name, value in (("tp", tp), ("max_model_len", max_model_len)) if value is not None}
            model = model_cls(config, **given)
    finally:
        torch.set_default_dtype(default_dtype)
    load_weights(model, checkpoint)
    return model
