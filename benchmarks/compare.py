"""Compare engines on the same workloads, each engine in a process of its own.

    .venv/bin/python -m benchmarks.compare \\
        --engines liteinfer:bf16,liteinfer:fp32,transformers:bf16:32,llamacpp:bf16,llamacpp:q4_1 \\
        --workloads throughput,latency --num-prompts 32 --output-len 128 --compare transformers-bf16-32

An engine variant is `ENGINE:PRECISION[:OPTION...]` (see `runners/base.py`): engines liteinfer, transformers,
llamacpp (`pip install -e '.[bench]'`) and vllm (when installed); an engine that is not installed gets a row that
says so. Workloads are described in `workloads.py`, metrics in `metrics.py`.

Every (engine, workload) pair runs in a fresh process: load the model, run `--warmup-rounds` rounds of a workload of
the same kind from another seed (not measured), then the workload itself, then check that every request produced
exactly its forced number of tokens (a row that did not fails, and the command exits non-zero). Results go to
benchmarks/results/compare-<time>.json with the git revision, the machine and each workload's hash, next to a
self-contained HTML dashboard and a PNG of the headline chart. `--compare NAME` adds each row's ratios to engine
NAME's row of the same workload (this ÷ baseline: above 1 is better for throughput, worse for latency and memory).

`--rounds N` measures every engine N times, the engines taking turns within each round (A, B, C, A, B, C, ...), so
that a slow minute of the machine falls on all of them alike: a row then holds each metric's median over its rounds,
and each ratio is the median of the N ratios taken within a round (the report adds their range). A CPU shared with
other tenants moves by tens of percent from minute to minute, more than a single pass can tell two close engines
apart by.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import statistics
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from benchmarks.metrics import PeakMemory, RequestTrace, check_output_lengths, ratios, summarize
from benchmarks.record import RESULTS_DIR, provenance, result_stem
from benchmarks.runners.base import EngineRunner, EngineSpec, runner_class, unavailable
from benchmarks.workloads import (
    WORKLOAD_NAMES,
    Sampling,
    Workload,
    WorkloadParams,
    make_workload,
    warmup_workload,
)

# The ratios the report prints; the JSON holds them for every metric.
REPORT_RATIOS = {"output_tokens_per_s": "output tok/s", "ttft_p50_ms": "TTFT p50", "itl_p50_ms": "ITL p50",
                 "e2e_p50_ms": "E2E p50", "peak_memory_mib": "memory"}


# ----------------------------------------------------------------------------------------------------------------
# In the engine's process


def serve(runner: EngineRunner, workload: Workload) -> list[RequestTrace]:
    if workload.one_at_a_time:
        return [trace for request in workload.requests for trace in runner.run([request])]
    return runner.run(workload.requests)


def measure(spec: EngineSpec, model: str, threads: int, workload: Workload, warmup: Workload, rounds: int) -> dict:
    """Runs in a fresh process: start the engine, warm it up, measure one pass of `workload`, check it."""
    max_num_seqs = max(1 if w.one_at_a_time else len(w.requests) for w in (workload, warmup))
    max_seq_len = max(len(r.prompt_token_ids) + r.output_len for w in (workload, warmup) for r in w.requests)
    runner = runner_class(spec.engine)(spec, model, threads, max_num_seqs, max_seq_len)
    try:
        runner.start()
        try:
            for _ in range(rounds):
                serve(runner, warmup)
            with PeakMemory(runner.device) as peak:
                traces = serve(runner, workload)
        finally:
            runner.stop()
    except Exception as exc:
        # The error goes back to the harness's process pickled, which some refuse (inductor's holds a module): its
        # traceback is printed here, its text sent.
        traceback.print_exception(exc)
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from None
    check_output_lengths(workload, traces)
    return {
        "metrics": asdict(summarize(workload, traces)) | {"peak_memory_mib": peak.mib},
        "memory": peak.kind,
        "device": runner.device,
        "timing": runner.timing,
        "details": runner.details,
        "requests": [{"ttft_ms": (t.token_times[0] - t.submitted) * 1000,
                      "e2e_ms": (t.token_times[-1] - t.submitted) * 1000, "token_ids": t.token_ids} for t in traces],
    }


# ----------------------------------------------------------------------------------------------------------------
# In the harness's process


def run_isolated(spec: EngineSpec, workload: Workload, warmup: Workload, args: argparse.Namespace) -> dict:
    row: dict[str, Any] = {"engine": spec.name, "spec": spec.text, "workload": workload.name,
                           "workload_hash": workload.hash}
    if reason := unavailable(spec.engine):
        return row | {"status": "skipped", "error": reason}
    # spawn, not fork: the child starts from nothing, so no engine state or thread pool leaks between engines.
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            result = pool.submit(measure, spec, args.model, args.threads, workload, warmup, args.warmup_rounds)
            return row | {"status": "ok"} | result.result()
        except Exception as exc:  # one engine's failure (or crash) must not stop the others
            traceback.print_exception(exc)
            return row | {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}


def ordinary_token_ids(model: str) -> list[int]:
    """The model's vocabulary without its special tokens: what prompts are drawn from."""
    # Imported here, not at the top: each engine's process imports this module (spawn re-imports the main module),
    # and its memory must not include libraries that only the harness uses. Likewise matplotlib below.
    from liteinfer.models.source import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(model))
    special = set(tokenizer.all_special_ids)
    return [i for i in range(tokenizer.vocab_size) if i not in special]


def combine_rounds(rounds: list[dict]) -> dict:
    """One engine's rows of one workload, a row a round, as one row: each metric's median over the rounds, with every
    round's metrics under "rounds". A round that did not run ok stands for the engine instead."""
    for row in rounds:
        if row["status"] != "ok":
            return row
    per_round = [row["metrics"] for row in rounds]
    medians = {key: statistics.median(metrics[key] for metrics in per_round) for key in per_round[0]}
    return rounds[0] | {"metrics": medians, "rounds": per_round}


def _median_ratio(values: list[float | None]) -> float | None:
    return None if None in values else statistics.median(values)


def add_ratios(rows: list[dict], baseline: str, greedy: bool = True) -> None:
    """Each row's metrics divided by the baseline's, round by round (the baseline's measurement of the same round),
    as the median of those ratios ("vs_baseline") and each round's ("vs_baseline_rounds"); and, when the workloads
    are `greedy`, how many of its outputs are the baseline's token for token (a check that the engines compute the
    same model; lower precisions legitimately flip near-ties). Sampled outputs are draws, equal only by chance."""
    base = {row["workload"]: row for row in rows if row["engine"] == baseline and row["status"] == "ok"}
    for row in rows:
        if row["status"] == "ok" and row["workload"] in base:
            other = base[row["workload"]]
            per_round = [ratios(mine, theirs) for mine, theirs in
                         zip(row.get("rounds", [row["metrics"]]), other.get("rounds", [other["metrics"]]))]
            row["vs_baseline_rounds"] = per_round
            row["vs_baseline"] = {key: _median_ratio([r[key] for r in per_round]) for key in per_round[0]}
            if greedy:
                row["same_outputs_as_baseline"] = sum(
                    a["token_ids"] == b["token_ids"] for a, b in zip(row["requests"], other["requests"]))


def _ratio_cell(row: dict, key: str) -> str:
    """The median ratio, and with several rounds the range of the rounds' own ratios."""
    median = row.get("vs_baseline", {}).get(key)
    if median is None:
        return "–"
    per_round = [r[key] for r in row.get("vs_baseline_rounds", [])]
    return f"{median:.2f}" + (f" ({min(per_round):.2f}–{max(per_round):.2f})" if len(per_round) > 1 else "")


def report(record: dict) -> str:
    """Markdown tables, one per workload."""
    baseline = record["baseline"]
    ratio_names = list(REPORT_RATIOS.values()) if baseline else []
    rounds = record.get("rounds", 1)
    lines = [f"{record['date']}, revision {record['revision']}{' (uncommitted changes)' if record['dirty'] else ''}"
             f", {record['machine']['cpu']} ({record['machine']['cores']} cores), {record['threads']} threads"
             + (f"; medians of {rounds} rounds, the engines taking turns in each" if rounds > 1 else ""),
             f"model {record['model']}" + (f"; ratios are this ÷ {baseline}" if baseline else "")]
    for name, workload in record["workloads"].items():
        lines += ["", f"### {workload['description']} (workload {workload['hash']})", "",
                  "| engine | req/s | output tok/s | total tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
                  "TPOT p50 / p99 ms | E2E p50 / p99 ms | peak MiB |" + "".join(f" × {r} |" for r in ratio_names)
                  + (" same outputs |" if baseline else ""),
                  "|---" * (9 + len(ratio_names) + bool(baseline)) + "|"]
        for row in (r for r in record["rows"] if r["workload"] == name):
            if row["status"] != "ok":
                lines.append(f"| {row['engine']} | {row['status']}: {row['error']} |")
                continue
            m = row["metrics"]
            cells = [row["engine"], f"{m['requests_per_s']:.2f}", f"{m['output_tokens_per_s']:.1f}",
                     f"{m['total_tokens_per_s']:.1f}", f"{m['ttft_p50_ms']:.0f} / {m['ttft_p99_ms']:.0f}",
                     f"{m['itl_p50_ms']:.1f} / {m['itl_p99_ms']:.1f}", f"{m['tpot_p50_ms']:.1f} / "
                     f"{m['tpot_p99_ms']:.1f}", f"{m['e2e_p50_ms']:.0f} / {m['e2e_p99_ms']:.0f}",
                     f"{m['peak_memory_mib']:.0f}"]
            if baseline:
                cells += [_ratio_cell(row, key) for key in REPORT_RATIOS]
                same = row.get("same_outputs_as_baseline")
                cells.append("–" if same is None else f"{same}/{len(row['requests'])}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = WorkloadParams()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="liteinfer:bf16,transformers:bf16",
                        help="comma-separated ENGINE:PRECISION[:OPTION...] (default: %(default)s)")
    parser.add_argument("--workloads", default="throughput,latency",
                        help=f"comma-separated, from {', '.join(WORKLOAD_NAMES)} (default: %(default)s)")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--num-prompts", type=int, default=defaults.num_prompts)
    parser.add_argument("--prompt-len", default=f"{defaults.prompt_min}-{defaults.prompt_max}",
                        help="MIN-MAX prompt tokens (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=defaults.output_len)
    parser.add_argument("--prefix-len", type=int, default=defaults.prefix_len, help="shared prefix (prefix workload)")
    parser.add_argument("--latency-prompts", type=int, default=defaults.latency_prompts,
                        help="requests of the latency workload (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--temperature", type=float, default=defaults.sampling.temperature,
                        help="0 (default): every engine greedy; above 0: every engine samples at this temperature")
    parser.add_argument("--top-p", type=float, default=defaults.sampling.top_p,
                        help="sampled workloads: the smallest set of tokens with this much probability (default: all)")
    parser.add_argument("--top-k", type=int, default=defaults.sampling.top_k,
                        help="sampled workloads: only the k likeliest tokens (default: 0, no limit)")
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--warmup-output-len", type=int, default=16, help="output tokens per warm-up request")
    parser.add_argument("--threads", type=int, default=psutil.cpu_count(logical=False) or os.cpu_count(),
                        help="CPU threads per engine (default: the physical cores, %(default)s)")
    parser.add_argument("--compare", metavar="NAME", help="baseline engine name, e.g. transformers-bf16-32")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure each engine this many times, the engines taking turns (default: %(default)s)")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)

    try:
        args.specs = [EngineSpec.parse(text) for text in args.engines.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    names = [spec.name for spec in args.specs]
    if len(set(names)) != len(names):
        parser.error(f"engine names must be distinct, got {names}")
    if args.compare and args.compare not in names:
        parser.error(f"--compare {args.compare!r} is not one of the engines: {', '.join(names)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    args.workload_names = args.workloads.split(",")
    if unknown := set(args.workload_names) - set(WORKLOAD_NAMES):
        parser.error(f"unknown workload(s) {sorted(unknown)}; choose from {', '.join(WORKLOAD_NAMES)}")
    prompt_min, _, prompt_max = args.prompt_len.partition("-")
    try:
        sampling = Sampling(args.temperature, args.top_p, args.top_k)
        args.params = WorkloadParams(args.num_prompts, int(prompt_min), int(prompt_max or prompt_min),
                                     args.output_len, args.prefix_len, args.latency_prompts, args.seed, sampling)
        if "latency" in args.workload_names:  # (refused before any engine runs)
            make_workload("latency", args.params, range(1, 2))
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    token_ids = ordinary_token_ids(args.model)
    record: dict[str, Any] = {
        **provenance(),
        "command": shlex.join(["python", "-m", "benchmarks.compare", *(sys.argv[1:] if argv is None else argv)]),
        "model": args.model,
        "threads": args.threads,
        "params": asdict(args.params),
        "warmup": {"rounds": args.warmup_rounds, "output_len": args.warmup_output_len},
        "baseline": args.compare,
        "rounds": args.rounds,
        "workloads": {},
        "rows": [],
    }
    for name in args.workload_names:
        workload = make_workload(name, args.params, token_ids)
        warmup = warmup_workload(name, args.params, token_ids, args.warmup_output_len)
        record["workloads"][name] = {"hash": workload.hash, "description": workload.describe(),
                                     "prompt_tokens": workload.num_prompt_tokens,
                                     "output_tokens": workload.num_output_tokens}
        rounds: dict[str, list[dict]] = {spec.name: [] for spec in args.specs}
        for number in range(1, args.rounds + 1):
            for spec in args.specs:
                if rounds[spec.name] and rounds[spec.name][-1]["status"] != "ok":
                    continue  # skipped or failed once: the row says why, and later rounds would only repeat it
                print(f"{spec.name} / {name}" + (f" (round {number} of {args.rounds})" if args.rounds > 1 else "")
                      + " ...", file=sys.stderr, flush=True)
                row = run_isolated(spec, workload, warmup, args)
                if row["status"] != "ok":
                    print(f"{row['status'].upper()} {spec.name} / {name}: {row['error']}", file=sys.stderr, flush=True)
                else:  # each row as it comes, for a run stopped before its report
                    m = row["metrics"]
                    print(f"  {m['output_tokens_per_s']:.1f} output tok/s, ITL p50 {m['itl_p50_ms']:.2f} ms, "
                          f"TTFT p50 {m['ttft_p50_ms']:.0f} ms", file=sys.stderr, flush=True)
                rounds[spec.name].append(row)
        record["rows"] += [combine_rounds(engine_rounds) for engine_rounds in rounds.values()]
    if args.compare:
        add_ratios(record["rows"], args.compare, greedy=args.params.sampling.greedy)

    stem = result_stem("compare", args.output_dir)
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2))
    from benchmarks.dashboard import write_dashboard  # see ordinary_token_ids

    write_dashboard(record, stem.with_suffix(".html"), stem.with_suffix(".png"))
    print(report(record))
    print(f"\nwrote {stem}.json, .html and .png", file=sys.stderr)
    return 1 if any(row["status"] == "failed" for row in record["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
