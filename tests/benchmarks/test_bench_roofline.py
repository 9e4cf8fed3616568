"""The linears-only roofline runner: the steps it simulates, and the matmuls it runs in each."""

import sys
from pathlib import Path

import pytest

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


def test_steps_follow_continuous_batching_with_chunked_prefill(runner, monkeypatch):
    steps = []
    step = runner._step
    monkeypatch.setattr(runner, "_step", lambda tokens, sampled: steps.append((tokens, sampled)) or step(tokens,
                                                                                                       sampled))
    requests = [BenchRequest([1] * 10, 3), BenchRequest([1] * 20, 2), BenchRequest([1] * 5, 4)]
    traces = runner.run(requests)

    assert [len(t.token_ids) for t in traces] == [3, 2, 4]
    assert all(t.token_times == sorted(t.token_times) for t in traces)
    # 1: prompt 0 whole (10) + 6 of prompt 1 (two running at most); 2: decode 0 + the rest of prompt 1 (14);
    # 3: both decode, and both are done; 4: prompt 2, admitted now, whole; then its 3 decodes.
    assert steps == [(16, 1), (15, 2), (2, 2), (5, 1), (1, 1), (1, 1), (1, 1)]
    assert all(tokens <= 16 for tokens, _ in steps)
    assert sum(sampled for _, sampled in steps) == 3 + 2 + 4


def test_every_linear_of_the_model_and_the_lm_head(runner, tiny_llama_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama_dir)
    assert len(runner.linears) == 4 * config.num_hidden_layers  # qkv, o, gate_up, down
    assert runner.lm_head.out_features == config.vocab_size
    assert runner.details["linears_per_step"] == 4 * config.num_hidden_layers + 1


def test_unknown_option_is_refused(tiny_llama_dir):
    spec = EngineSpec.parse("roofline:fp32:block_size=8")
    with pytest.raises(ValueError, match="roofline options"):
        LinearsRooflineRunner(spec, str(tiny_llama_dir), threads=1, max_num_seqs=1, max_seq_len=8).start()
