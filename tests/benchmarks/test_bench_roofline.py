"""The linears-only roofline runner: the steps it simulates, and the matmuls it runs in each."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the benchmarks package lives at the repo root

from benchmarks.runners.base import EngineSpec  # noqa: E402
from benchmarks.runners.roofline import LinearsRooflineRunner  # noqa: E402
from benchmarks.workloads import BenchRequest  # noqa: E402


@pytest.fixture
def runner(tiny_llama_dir):
    spec = EngineSpec.parse("roofline:fp32:max_num_batched_tokens=16:max_num_seqs=2")
    runner = LinearsRooflineRunner(spec, str(tiny_llama_dir), threads=1, max_num_seqs=3, max_seq_len=64)
    runner.start()
    return runner


def record_steps(runner, monkeypatch) -> list[tuple[int, int, int]]:
    steps = []
    step = runner._step
    monkeypatch.setattr(runner, "_step", lambda *args: steps.append(args) or step(*args))
    return steps


def test_steps_follow_continuous_batching_with_chunked_prefill(runner, monkeypatch):
    steps = record_steps(runner, monkeypatch)
    requests = [BenchRequest([1] * 10, 3), BenchRequest([1] * 20, 2), BenchRequest([1] * 5, 4)]
    traces = runner.run(requests)

    assert [len(t.token_ids) for t in traces] == [3, 2, 4]
    assert all(t.token_times == sorted(t.token_times) for t in traces)
    # (tokens, sampled, keys read). 1: prompt 0 whole (10) + 6 of prompt 1 (two running at most), reading the keys
    # they write; 2: decode 0 (its 10 prompt keys and 1 generated) + the rest of prompt 1 (14, over all 20 keys);
    # 3: both decode (10 + 2, 20 + 1), and both are done; 4: prompt 2, admitted now, whole; then its 3 decodes.
    assert steps == [(16, 1, 16), (15, 2, 31), (2, 2, 33), (5, 1, 5), (1, 1, 6), (1, 1, 7), (1, 1, 8)]
    assert all(tokens <= 16 for tokens, _, _ in steps)
    assert sum(sampled for _, sampled, _ in steps) == 3 + 2 + 4
    assert runner.kv_bytes_per_key == 0 and runner.kv_buffer.numel() == 0  # linears only: no cache read


@pytest.mark.parametrize("kv_reads, row_bytes", [("auto", 16 * 4), ("int8", 16 + 4)])
def test_kv_reads_cover_every_layers_rows_of_each_steps_keys(tiny_llama_dir, monkeypatch, kv_reads, row_bytes):
    """The tiny Llama: 2 layers, 2 KV heads of 16 (fp32: 4 bytes an element; int8: 1 and a 4-byte scale a row)."""
    spec = EngineSpec.parse(f"roofline:fp32:max_num_batched_tokens=16:kv_reads={kv_reads}")
    runner = LinearsRooflineRunner(spec, str(tiny_llama_dir), threads=1, max_num_seqs=2, max_seq_len=64)
    runner.start()
    assert runner.kv_bytes_per_key == 2 * 2 * 2 * row_bytes == runner.details["kv_bytes_per_key"]

    sums = []
    monkeypatch.setattr(torch.Tensor, "sum", lambda self, *args: sums.append(self.numel()))
    steps = record_steps(runner, monkeypatch)
    runner.run([BenchRequest([1] * 10, 2), BenchRequest([1] * 3, 3)])

    assert runner.kv_buffer.numel() * 4 >= (10 + 2 + 3 + 3) * runner.kv_bytes_per_key  # both caches whole
    assert [keys for _, _, keys in steps] == [13, 15, 5]  # both prompts; both decodes (11 + 4); the last (3 + 2)
    assert sums == [keys * runner.kv_bytes_per_key // 4 for _, _, keys in steps]  # each step's bytes, as floats


def test_kv_reads_must_name_a_cache_precision(tiny_llama_dir):
    spec = EngineSpec.parse("roofline:fp32:kv_reads=fp8")
    with pytest.raises(ValueError, match="kv_reads is auto"):
        LinearsRooflineRunner(spec, str(tiny_llama_dir), threads=1, max_num_seqs=1, max_seq_len=8).start()


def test_every_linear_of_the_model_and_the_lm_head(runner, tiny_llama_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama_dir)
    assert len(runner.linears) == 4 * config.num_hidden_layers  # qkv, o, gate_up, down
    assert runner.lm_head.out_features == config.vocab_size
    assert runner.details["linears_per_step"] == 4 * config.num_hidden_layers + 1


def test_weights_move_to_huge_pages_as_the_engines_do(tiny_llama_dir, monkeypatch):
    """The roofline's packed weights go where the engine's go (huge_pages.move), so that it is no slower for lying on
    4 KiB pages."""
    from liteinfer import huge_pages

    moved = []
    monkeypatch.setattr(huge_pages, "move", lambda tensors: moved.extend(tensors) or 0)
    spec = EngineSpec.parse("roofline:fp32")
    runner = LinearsRooflineRunner(spec, str(tiny_llama_dir), threads=1, max_num_seqs=1, max_seq_len=8)
    runner.start()
    weights = {id(module.weight) for module in [*runner.linears, runner.lm_head]}
    assert weights <= {id(tensor) for tensor in moved}


def test_unknown_option_is_refused(tiny_llama_dir):
    spec = EngineSpec.parse("roofline:fp32:block_size=8")
    with pytest.raises(ValueError, match="roofline options"):
        LinearsRooflineRunner(spec, str(tiny_llama_dir), threads=1, max_num_seqs=1, max_seq_len=8).start()
