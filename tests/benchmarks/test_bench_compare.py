"""`python -m benchmarks.compare` end to end on a tiny model: liteinfer and transformers, each in its process."""

import json
import pickle
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import compare
from benchmarks.runners.base import EngineSpec
from benchmarks.workloads import WorkloadParams, make_workload

REPO_ROOT = Path(__file__).resolve().parents[2]

ROW_METRICS = {"duration_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "ttft_p50_ms",
               "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
               "peak_memory_mib"}


def test_compare_smoke_run(tiny_llama_dir, tmp_path):
    command = [sys.executable, "-m", "benchmarks.compare", "--model", str(tiny_llama_dir),
               "--engines", "liteinfer:fp32,transformers:fp32:1,vllm:bf16", "--workloads", "throughput",
               "--num-prompts", "2", "--output-len", "4", "--compare", "transformers-fp32-1",
               "--rounds", "2", "--output-dir", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr

    [json_path] = tmp_path.glob("compare-*.json")
    assert json_path.with_suffix(".html").read_text().startswith("<!doctype html>")
    assert json_path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    record = json.loads(json_path.read_text())
    assert {"date", "revision", "dirty", "machine", "command", "model", "params", "workloads", "rows"} <= set(record)
    assert {"cpu", "cores", "memory_gib"} <= set(record["machine"])
    workload_hash = record["workloads"]["throughput"]["hash"]
    assert record["rounds"] == 2 and len(record["rows"]) == 3  # one row an engine, its rounds inside
    rows = {row["engine"]: row for row in record["rows"]}
    for name in ("liteinfer-fp32", "transformers-fp32-1"):
        row = rows[name]
        assert row["status"] == "ok" and row["workload_hash"] == workload_hash
        assert set(row["metrics"]) == ROW_METRICS and row["metrics"]["output_tokens_per_s"] > 0
        assert row["memory"] == "rss" and row["timing"]
        assert [len(r["token_ids"]) for r in row["requests"]] == [4, 4]
        assert len(row["rounds"]) == 2 and len(row["vs_baseline_rounds"]) == 2
    # Same weights, fp32, greedy: the two engines agree token for token.
    assert rows["liteinfer-fp32"]["same_outputs_as_baseline"] == 2
    assert rows["transformers-fp32-1"]["vs_baseline"]["output_tokens_per_s"] == 1.0
    if rows["vllm-bf16"]["status"] == "skipped":
        assert "not installed" in rows["vllm-bf16"]["error"]
    assert "| liteinfer-fp32 |" in done.stdout and "medians of 2 rounds" in done.stdout
    assert done.stderr.count("vllm-bf16 / throughput (round") == 1  # skipped once, not asked again


def test_an_engines_error_reaches_the_harness_as_text_it_can_unpickle(monkeypatch, capsys):
    """An engine's error crosses back from its process pickled; inductor's hold a module, which pickle refuses, and
    the row then named the pickling failure instead of the engine's."""

    class CompileFailed(Exception):
        pass

    class FailingRunner:
        def __init__(self, *args):
            pass

        def start(self):
            error = CompileFailed("the graph did not compile")
            error.module = json  # what inductor's errors carry
            raise error

    monkeypatch.setattr(compare, "runner_class", lambda engine: FailingRunner)
    workload = make_workload("latency", WorkloadParams(latency_prompts=1, output_len=2), list(range(100, 200)))
    with pytest.raises(RuntimeError) as raised:
        compare.measure(EngineSpec.parse("liteinfer:bf16"), "model", 1, workload, workload, 1)

    sent = pickle.loads(pickle.dumps(raised.value))
    assert str(sent) == "CompileFailed: the graph did not compile"
    assert "CompileFailed" in capsys.readouterr().err  # the whole traceback stays in the engine's output


@pytest.mark.slow
def test_llamacpp_fp32_computes_the_same_tokens_as_liteinfer(tmp_path):
    """The re-encoded fp32 GGUF and the batched low-level decode loop give liteinfer's greedy tokens (real model),
    with llama.cpp's own f16 K/V cache or, asked for (`kv_cache=f32`), an fp32 one."""
    pytest.importorskip("llama_cpp", reason="llama.cpp is optional: pip install -e '.[bench]'")
    command = [sys.executable, "-m", "benchmarks.compare", "--engines",
               "liteinfer:fp32,llamacpp:fp32,llamacpp:fp32:kv_cache=f32",
               "--workloads", "throughput", "--num-prompts", "3", "--output-len", "8", "--compare", "liteinfer-fp32",
               "--warmup-rounds", "0", "--output-dir", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    [json_path] = tmp_path.glob("compare-*.json")
    rows = {row["engine"]: row for row in json.loads(json_path.read_text())["rows"]}
    for engine, kv_cache_type in (("llamacpp-fp32", "F16"), ("llamacpp-fp32-kv_cache=f32", "F32")):
        assert rows[engine]["same_outputs_as_baseline"] == 3
        assert rows[engine]["details"]["kv_cache_type"] == kv_cache_type


@pytest.mark.slow
def test_llamacpp_runs_its_native_q4_1_file_without_extra_buffers(tmp_path):
    """`extra_bufts=false` reaches llama.cpp's loader: the Q4_1 file runs without its repacked buffers (whose AMX
    repack dies on an AMX CPU) and gives every forced token; a value that is not a bool fails the row, as does a K/V
    cache type llama.cpp is not offered."""
    pytest.importorskip("llama_cpp", reason="llama.cpp is optional: pip install -e '.[bench]'")
    command = [sys.executable, "-m", "benchmarks.compare",
               "--engines", "llamacpp:q4_1:extra_bufts=false,llamacpp:q4_1:extra_bufts=no,llamacpp:q4_1:kv_cache=q8",
               "--workloads", "throughput", "--num-prompts", "2", "--output-len", "4",
               "--warmup-rounds", "0", "--output-dir", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr  # the run exits 1 when any of its rows failed
    [json_path] = tmp_path.glob("compare-*.json")
    rows = {row["engine"]: row for row in json.loads(json_path.read_text())["rows"]}
    ran = rows["llamacpp-q4_1-extra_bufts=false"]
    assert ran["status"] == "ok" and ran["details"]["extra_bufts"] is False
    assert ran["details"]["source_type"] == "MOSTLY_Q4_1"
    assert [len(r["token_ids"]) for r in ran["requests"]] == [4, 4]
    refused = rows["llamacpp-q4_1-extra_bufts=no"]
    assert refused["status"] == "failed" and "extra_bufts is true or false" in refused["error"]
    refused = rows["llamacpp-q4_1-kv_cache=q8"]
    assert refused["status"] == "failed" and "kv_cache is one of f32, f16, bf16" in refused["error"]


@pytest.mark.parametrize("spec", ["liteinfer:fp32", "transformers:fp32:2"])
def test_runners_sample_when_the_requests_ask(spec, tiny_llama_dir):
    """Sampled requests reach the engine: at temperature 1 a random tiny model's draws leave its greedy tokens (at
    near-uniform odds over its 1,000 likeliest tokens, a draw equal to all 12 greedy tokens has no practical chance),
    and each request still gets exactly its forced count."""
    from benchmarks.runners.base import runner_class
    from benchmarks.workloads import BenchRequest, Sampling

    parsed = EngineSpec.parse(spec)
    runner = runner_class(parsed.engine)(parsed, str(tiny_llama_dir), 1, 2, 16)
    runner.start()
    try:
        greedy = [BenchRequest([5, 6, 7], 6), BenchRequest([8, 9], 6)]
        sampled = [replace(r, sampling=Sampling(temperature=1.0, top_k=1000)) for r in greedy]
        greedy_tokens = [trace.token_ids for trace in runner.run(greedy)]
        sampled_tokens = [trace.token_ids for trace in runner.run(sampled)]
        if parsed.engine == "transformers":  # generate samples a batch one way
            with pytest.raises(ValueError, match="share their sampling"):
                runner.run([greedy[0], sampled[1]])
    finally:
        runner.stop()
    assert [len(t) for t in sampled_tokens] == [6, 6] and sampled_tokens != greedy_tokens


@pytest.mark.slow
def test_llamacpp_samples_when_the_requests_ask(monkeypatch):
    """llama.cpp's chain for sampled requests (temperature, top-k, top-p, a draw) in the real model: at temperature
    1.5 its 16 drawn tokens leave the greedy ones, each request gets its forced count, and greedy stays greedy."""
    pytest.importorskip("llama_cpp", reason="llama.cpp is optional: pip install -e '.[bench]'")
    from benchmarks.runners import llamacpp
    from benchmarks.runners.base import runner_class
    from benchmarks.workloads import BenchRequest, Sampling

    spec = EngineSpec.parse("llamacpp:fp32")
    runner = runner_class("llamacpp")(spec, "SmolLM2-135M-Instruct", 2, 2, 64)
    runner.start()
    sampled_at = []  # when each token was drawn: its timestamp may not come before that
    draw = llamacpp.C.llama_sampler_sample
    monkeypatch.setattr(llamacpp.C, "llama_sampler_sample", lambda *args: (draw(*args),
                                                                           sampled_at.append(time.perf_counter()))[0])
    try:
        greedy = [BenchRequest([1266, 314, 253], 8), BenchRequest([504, 3575, 282, 4194], 8)]
        sampled = [replace(r, sampling=Sampling(temperature=1.5, top_p=0.99, top_k=200)) for r in greedy]
        first, drawn, again = (runner.run(requests) for requests in (greedy, sampled, greedy))
    finally:
        runner.stop()
    tokens = [[trace.token_ids for trace in traces] for traces in (first, drawn, again)]
    assert tokens[0] == tokens[2] and tokens[1] != tokens[0]
    assert [len(t) for t in tokens[1]] == [8, 8]
    stamped = sorted(time for traces in (first, drawn, again) for trace in traces for time in trace.token_times)
    assert len(stamped) == len(sampled_at) and all(stamp >= at for stamp, at in zip(stamped, sorted(sampled_at)))
