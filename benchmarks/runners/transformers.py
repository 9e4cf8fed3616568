"""Hugging Face `transformers` `generate`: the fair baseline. Requests go in left-padded batches of a chosen width
(`transformers:bf16:32`; default: all of them), one batch after another, greedy or sampled as the requests say,
with `min_new_tokens = max_new_tokens` so that EOS never ends a row early. The weights are the very files liteinfer
loads."""

from __future__ import annotations

import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from benchmarks.metrics import RequestTrace
from benchmarks.runners.base import TORCH_DTYPES, EngineRunner
from benchmarks.workloads import BenchRequest
from liteinfer.models.source import resolve_model


class StepClock(BaseStreamer):
    """Records when each decoding step's tokens reach the host. `generate` calls `put` once with the prompts, then
    once per step with the new token of every row of the batch."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._saw_prompts = False

    def put(self, value: torch.Tensor) -> None:
        if self._saw_prompts:
            self.times.append(time.perf_counter())
        self._saw_prompts = True

    def end(self) -> None:
        pass


class TransformersRunner(EngineRunner):
    timing = ("one timestamp per decoding step for the whole batch (a streamer's put, after the step's tokens "
              "reach the host); batches run one after another, so a later batch's TTFT includes the earlier "
              "batches; in a batch of mixed output lengths a row's last token is its own, but the batch runs on "
              "to its longest row")

    def start(self) -> None:
        torch.set_num_threads(self.threads)
        if self.spec.precision not in TORCH_DTYPES:
            raise ValueError(f"transformers runs {', '.join(TORCH_DTYPES)}, not {self.spec.precision!r}")
        unknown = set(self.spec.options) - {"batch"}
        if unknown:
            raise ValueError(f"transformers takes only a batch width option, got {sorted(unknown)}")
        transformers.logging.set_verbosity_error()  # not a warning per batch about the generation config
        path = resolve_model(self.model).path  # liteinfer's own resolution: the same weights for both
        dtype = getattr(torch, TORCH_DTYPES[self.spec.precision])
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.details = {"transformers": transformers.__version__, "torch": torch.__version__,
                        "threads": torch.get_num_threads(), "batch": self.spec.options.get("batch", "all"),
                        "attention": self.hf_model.config._attn_implementation}

    def run(self, requests: list[BenchRequest]) -> list[RequestTrace]:
        width = self.spec.options.get("batch", len(requests))
        submitted = time.perf_counter()
        traces = []
        for start in range(0, len(requests), width):
            traces += self._generate(requests[start:start + width], submitted)
        return traces

    @torch.inference_mode()
    def _generate(self, batch: list[BenchRequest], submitted: float) -> list[RequestTrace]:
        longest = max(len(r.prompt_token_ids) for r in batch)
        padding = [longest - len(r.prompt_token_ids) for r in batch]
        input_ids = torch.tensor([[self.pad_token_id] * pad + r.prompt_token_ids for pad, r in zip(padding, batch)])
        attention_mask = torch.tensor([[0] * pad + [1] * (longest - pad) for pad in padding])
        num_new = max(r.output_len for r in batch)
        sampling = batch[0].sampling
        if any(r.sampling != sampling for r in batch):
            raise ValueError("generate samples a whole batch one way: its requests must share their sampling")
        # Sampled: temperature, then top-k (0: none; the model's generation config may set one otherwise), then top-p.
        how = {"do_sample": False} if sampling.greedy else {
            "do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}
        clock = StepClock()
        output = self.hf_model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
            max_new_tokens=num_new, min_new_tokens=num_new, pad_token_id=self.pad_token_id, streamer=clock, **how,
        )
        new_tokens = output[:, longest:].tolist()
        return [RequestTrace(submitted, clock.times[:r.output_len], new_tokens[row][:r.output_len])
                for row, r in enumerate(batch)]
