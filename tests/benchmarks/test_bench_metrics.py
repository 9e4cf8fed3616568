"""Metrics math, output-length verification, engine specs and the --compare report, without any engine."""

import sys
import time
from pathlib import Path

import numpy as np
import pytest

# benchmarks/ sits at the repository root and is not installed with liteinfer: `python -m pytest` finds it through
# the working directory, `pytest` alone does not. (A conftest.py here would shadow tests/conftest.py's helpers.)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import compare  # noqa: E402
from benchmarks.metrics import (  # noqa: E402
    OutputLengthError,
    PeakMemory,
    RequestTrace,
    check_output_lengths,
    percentile,
    ratios,
    summarize,
)
from benchmarks.runners.base import EngineRunner, EngineSpec, run_step_loop, unavailable  # noqa: E402
from benchmarks.workloads import BenchRequest, Sampling, Workload  # noqa: E402


def test_percentile_interpolates_between_closest_ranks():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)


def test_summary_of_hand_made_traces():
    workload = Workload("w", [BenchRequest([1, 2, 3], 3), BenchRequest([4], 3)], one_at_a_time=False)
    traces = [
        RequestTrace(submitted=10.0, token_times=[10.5, 10.6, 10.8], token_ids=[7, 8, 9]),
        RequestTrace(submitted=10.0, token_times=[11.0, 11.1, 12.0], token_ids=[7, 8, 9]),
    ]
    s = summarize(workload, traces)
    assert s.duration_s == pytest.approx(2.0)
    assert s.requests_per_s == pytest.approx(1.0)
    assert s.output_tokens_per_s == pytest.approx(3.0)
    assert s.total_tokens_per_s == pytest.approx(5.0)  # (4 prompt + 6 output) / 2 s
    assert s.ttft_p50_ms == pytest.approx(750.0)
    assert s.ttft_p99_ms == pytest.approx(500 + 500 * 0.99)
    assert s.itl_p50_ms == pytest.approx(150.0)  # gaps 100, 200, 100, 900 ms
    assert s.itl_p99_ms == pytest.approx(percentile([100, 200, 100, 900], 99))
    assert s.e2e_p50_ms == pytest.approx(1400.0)
    # Time per output token after the first, a request at a time: (10.8 - 10.5) / 2 and (12.0 - 11.0) / 2.
    assert s.tpot_p50_ms == pytest.approx(325.0)
    assert s.tpot_p99_ms == pytest.approx(percentile([150, 500], 99))


def test_tokens_a_step_gives_together_count_in_tpot_not_as_zero_gaps():
    """Speculative decoding stamps several tokens at once: ITL's median is then 0, TPOT stays the request's pace."""
    workload = Workload("w", [BenchRequest([1], 4)], one_at_a_time=False)
    trace = RequestTrace(submitted=0.0, token_times=[1.0, 1.2, 1.2, 1.2], token_ids=[5, 6, 7, 8])
    s = summarize(workload, [trace])
    assert s.itl_p50_ms == 0.0 and s.tpot_p50_ms == pytest.approx(200 / 3)
    one_token = summarize(Workload("w", [BenchRequest([1], 1)], one_at_a_time=False), [RequestTrace(0.0, [1.0], [5])])
    assert one_token.tpot_p50_ms == 0.0  # no token after the first: undefined, reported as 0 (as ITL)


def test_wrong_output_lengths_fail_loudly():
    workload = Workload("w", [BenchRequest([1], 2), BenchRequest([1], 2)], one_at_a_time=False)
    good = RequestTrace(0.0, [1.0, 2.0], [5, 6])
    check_output_lengths(workload, [good, good])
    with pytest.raises(OutputLengthError, match="request 1: 1 tokens"):
        check_output_lengths(workload, [good, RequestTrace(0.0, [1.0], [5])])
    with pytest.raises(OutputLengthError, match="1 results for 2 requests"):
        check_output_lengths(workload, [good])
    with pytest.raises(OutputLengthError, match="1 timestamps"):  # tokens without their timestamps
        check_output_lengths(workload, [good, RequestTrace(0.0, [1.0], [5, 6])])


class ShortRunner(EngineRunner):
    """Pretends to be an engine that stops one token early."""

    def start(self):
        pass

    def run(self, requests):
        return [RequestTrace(0.0, [1.0] * (r.output_len - 1), [0] * (r.output_len - 1)) for r in requests]


def test_an_engine_that_returns_the_wrong_length_fails_its_row(monkeypatch):
    monkeypatch.setattr(compare, "runner_class", lambda engine: ShortRunner)
    workload = Workload("w", [BenchRequest([1, 2], 4)], one_at_a_time=True)
    with pytest.raises(OutputLengthError):
        compare.measure(EngineSpec.parse("liteinfer:fp32"), "model", 1, workload, workload, rounds=1)


def test_ratios_divide_by_the_baseline():
    assert ratios({"a": 3.0, "b": 1.0}, {"a": 1.5, "b": 0.0}) == {"a": 2.0, "b": None}


def test_engine_spec_parsing():
    spec = EngineSpec.parse("transformers:bfloat16:32")
    assert (spec.engine, spec.precision, spec.options, spec.name) == ("transformers", "bf16", {"batch": 32},
                                                                      "transformers-bfloat16-32")
    spec = EngineSpec.parse("liteinfer:f32:scheduler=static:max_num_seqs=8:enable_prefix_caching=false")
    assert spec.precision == "fp32"
    assert spec.options == {"scheduler": "static", "max_num_seqs": 8, "enable_prefix_caching": False}
    assert EngineSpec.parse("llamacpp:Q4_1").precision == "q4_1"
    with pytest.raises(ValueError, match="unknown engine"):
        EngineSpec.parse("tgi:bf16")
    with pytest.raises(ValueError, match="neither a batch width nor key=value"):
        EngineSpec.parse("liteinfer:bf16:fast")
    with pytest.raises(ValueError, match="names no precision"):
        EngineSpec.parse("liteinfer")


def test_missing_optional_engine_is_skipped_with_a_reason(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert "vllm skipped: vllm is not installed" in unavailable("vllm")
    assert unavailable("liteinfer") is None


def test_peak_memory_sees_an_allocation():
    with PeakMemory("cpu") as before:
        pass
    with PeakMemory("cpu") as peak:
        block = np.ones(64 * 2**20, dtype=np.uint8)  # 64 MiB, touched
        block.sum()
        # Held for several of the sampler's 10 ms periods: a shorter spike may fall between two samples (on a loaded
        # machine it did, failing a CI run).
        time.sleep(0.1)
        del block
    assert peak.kind == "rss" and peak.mib >= before.mib + 48


def _row(engine, workload, tok_s, tokens):
    metrics = {"requests_per_s": 1.0, "output_tokens_per_s": tok_s, "total_tokens_per_s": 2 * tok_s,
               "ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0, "itl_p50_ms": 5.0, "itl_p99_ms": 6.0, "tpot_p50_ms": 7.0,
               "tpot_p99_ms": 8.0, "e2e_p50_ms": 50.0, "e2e_p99_ms": 60.0, "duration_s": 1.0, "peak_memory_mib": 100.0}
    return {"engine": engine, "workload": workload, "status": "ok", "metrics": metrics,
            "requests": [{"token_ids": t} for t in tokens]}


def test_compare_report_has_ratios_and_output_agreement():
    rows = [_row("base", "throughput", 100.0, [[1, 2], [3, 4]]), _row("fast", "throughput", 250.0, [[1, 2], [3, 5]]),
            {"engine": "gone", "workload": "throughput", "status": "skipped", "error": "gone is not installed"}]
    compare.add_ratios(rows, "base")
    assert rows[1]["vs_baseline"]["output_tokens_per_s"] == pytest.approx(2.5)
    assert rows[1]["same_outputs_as_baseline"] == 1
    record = {"date": "today", "revision": "abc", "dirty": False, "threads": 2, "model": "m", "baseline": "base",
              "machine": {"cpu": "cpu", "cores": 2},
              "workloads": {"throughput": {"description": "throughput: 2 requests", "hash": "h"}}, "rows": rows}
    text = compare.report(record)
    assert "| fast | 1.00 | 250.0 | 500.0 | 10 / 20 | 5.0 / 6.0 | 7.0 / 8.0 | 50 / 60 | 100 | 2.50 |" in text
    assert text.count("| 1/2 |") == 1 and "| gone | skipped: gone is not installed |" in text

    # Sampled outputs are draws: the report counts no agreement for them.
    sampled = [_row("base", "throughput", 100.0, [[1, 2]]), _row("fast", "throughput", 250.0, [[1, 2]])]
    compare.add_ratios(sampled, "base", greedy=False)
    assert "same_outputs_as_baseline" not in sampled[1] and sampled[1]["vs_baseline"]["output_tokens_per_s"] == 2.5
    text = compare.report(record | {"rows": sampled})
    assert "| fast | 1.00 | 250.0 | 500.0 | 10 / 20 | 5.0 / 6.0 | 7.0 / 8.0 | 50 / 60 | 100 | 2.50 |" in text
    assert text.splitlines()[-1].endswith("| – |")


def test_sampling_on_the_command_line():
    args = compare.parse_args(["--temperature", "0.7", "--top-k", "40"])
    assert args.params.sampling == Sampling(temperature=0.7, top_p=1.0, top_k=40)
    assert compare.parse_args([]).params.sampling.greedy
    for refused in (["--top-p", "0.9"], ["--temperature", "-1"], ["--temperature", "1", "--top-p", "0"]):
        with pytest.raises(SystemExit):
            compare.parse_args(refused)


def test_the_step_loop_asks_the_engine_for_each_requests_sampling():
    """run_step_loop (liteinfer's and vLLM's runners) hands every request's sampling to the engine's params."""

    class Params:
        def __init__(self, **fields):
            self.fields = fields

    class Engine:
        def __init__(self):
            self.added = {}

        def add_request(self, request_id, prompt, params):
            self.added[request_id] = params.fields

        def has_unfinished_requests(self):
            return False

    engine = Engine()
    requests = [BenchRequest([1, 2], 3, Sampling(0.8, 0.95, 0)), BenchRequest([3], 2),
                BenchRequest([4], 2, Sampling(1.0, 1.0, 5))]
    run_step_loop(engine, Params, "delta", requests)
    asked = [(f["temperature"], f["top_p"], f["top_k"], f["max_tokens"], f["min_tokens"])
             for f in engine.added.values()]
    assert asked == [(0.8, 0.95, -1, 3, 3), (0.0, 1.0, -1, 2, 2), (1.0, 1.0, 5, 2, 2)]
    assert all(f["ignore_eos"] and f["output_kind"] == "delta" for f in engine.added.values())


def test_rounds_give_medians_and_ratios_taken_within_each_round():
    """Three rounds in which the machine's pace drifts: each ratio is taken within a round, then the median."""
    def rounds_of(engine, tok_s):
        return [_row(engine, "latency", v, [[1, 2]]) for v in tok_s]

    base = compare.combine_rounds(rounds_of("base", [100.0, 60.0, 80.0]))
    fast = compare.combine_rounds(rounds_of("fast", [110.0, 72.0, 84.0]))
    assert base["metrics"]["output_tokens_per_s"] == 80.0 and len(base["rounds"]) == 3
    failed = {"engine": "flaky", "workload": "latency", "status": "failed", "error": "RuntimeError: boom"}
    assert compare.combine_rounds([_row("flaky", "latency", 1.0, [[1]]), failed]) is failed

    rows = [base, fast]
    compare.add_ratios(rows, "base")
    assert [r["output_tokens_per_s"] for r in fast["vs_baseline_rounds"]] == pytest.approx([1.1, 1.2, 1.05])
    # The median of the rounds' ratios (1.10), not the ratio of the medians (84 / 80 = 1.05).
    assert fast["vs_baseline"]["output_tokens_per_s"] == pytest.approx(1.1)
    record = {"date": "today", "revision": "abc", "dirty": False, "threads": 2, "model": "m", "baseline": "base",
              "rounds": 3, "machine": {"cpu": "cpu", "cores": 2},
              "workloads": {"latency": {"description": "latency: 1 request", "hash": "h"}}, "rows": rows}
    text = compare.report(record)
    assert "medians of 3 rounds" in text
    assert "| fast | 1.00 | 84.0 | 168.0 | 10 / 20 | 5.0 / 6.0 | 7.0 / 8.0 | 50 / 60 | 100 | 1.10 (1.05–1.20) |" in text


def test_an_engine_spec_sets_a_dict_options_fields_by_dotted_keys():
    spec = EngineSpec.parse("liteinfer:fp32:speculative_config.num_speculative_tokens=4:"
                            "speculative_config.prompt_lookup_max=3:max_num_seqs=8")
    assert spec.options == {"speculative_config": {"num_speculative_tokens": 4, "prompt_lookup_max": 3},
                            "max_num_seqs": 8}


def test_a_run_recorded_before_tpot_redraws(tmp_path):
    """`python -m benchmarks.dashboard old.json`: a record without TPOT draws the latencies it has."""
    from benchmarks.dashboard import write_dashboard

    rows = [_row("base", "throughput", 100.0, [[1, 2]]), _row("fast", "throughput", 250.0, [[1, 2]])]
    for row in rows:
        row["timing"] = "when the step returns"
        del row["metrics"]["tpot_p50_ms"], row["metrics"]["tpot_p99_ms"]
    record = {"date": "today", "revision": "abc", "dirty": False, "threads": 2, "model": "m", "command": "compare",
              "machine": {"cpu": "cpu", "cores": 2, "memory_gib": 24, "gpu": None},
              "workloads": {"throughput": {"description": "throughput: 2 requests", "hash": "h"}}, "rows": rows}
    write_dashboard(record, tmp_path / "run.html", tmp_path / "run.png")
    page = (tmp_path / "run.html").read_text()
    assert "<td>–</td>" in page and (tmp_path / "run.png").stat().st_size > 0
