"""The GPU run, prepared: one command on a lent GPU machine checks CUDA parity and records GPU numbers.

A lent GPU machine (the `device` tool) starts bare from an image that has torch, Triton, transformers and pytest but
not all that liteinfer imports (`gguf`), reaches no network, and takes at most 64 MiB of the tree, so SmolLM2's
98 MB GGUF, which the tests' tokenizer comes from, cannot travel. Hence two steps:

    # here, after `make setup` (.gpu/ is git-ignored):
    .venv/bin/python -m benchmarks.gpu_session prepare .gpu
    # there, one call of the device tool with carry=[".gpu"] and timeout_s=600:
    python3 -m benchmarks.gpu_session run .gpu "$OUT"

`prepare` saves SmolLM2's tokenizer and config (~3.5 MB) and the wheels of what the image lacks. `run` installs
those wheels into a private folder, runs the `gpu` tests and the Triton decode kernel's property tests on CUDA
(the tests' tokenizer the saved one, `LITEINFER_TEST_TOKENIZER`), profiles the eager engine (`profile`), then runs
the harness on random weights in two shapes, SmolLM2's and a 1B Llama (weights' values do not change speed; every
output length is forced). The steps' log and each harness run's JSON and dashboard land in the output folder; a
failing step does not stop the next, and each stops at the run's deadline (`--budget`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

# What the image lacks that liteinfer imports (pure Python wheels; their own needs are in the image).
WHEELS = ["gguf>=0.10"]
# A 1B Llama's shape (Llama 3.2 1B's, SmolLM2's vocabulary so that its tokenizer serves).
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, tie_word_embeddings=True)
# A step that would start with less time left than this is skipped.
MIN_STEP_SECONDS = 30
# The baseline first, the compiled engine (the slowest start) last: a run stopped at its deadline keeps the others.
ENGINES = "transformers:bf16:32,liteinfer:bf16,liteinfer:bf16:enforce_eager=false"


def prepare(folder: Path) -> None:
    from liteinfer.models.source import load_config, load_tokenizer, resolve_model

    source = resolve_model("SmolLM2-135M-Instruct")
    load_tokenizer(source).save_pretrained(folder / "tokenizer")
    load_config(source).save_pretrained(folder / "tokenizer")
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "-d", str(folder / "wheels"), *WHEELS], check=True)


def random_model(folder: Path, destination: Path, **shape) -> Path:
    """SmolLM2's config with `shape` applied, random weights in bf16, saved the Hugging Face way with the tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(folder / "tokenizer")
    for name, value in shape.items():
        setattr(config, name, value)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(destination)
    AutoTokenizer.from_pretrained(folder / "tokenizer").save_pretrained(destination)
    return destination


def profile(model: Path, quick: bool) -> None:
    """Where the eager engine's time goes with 256 sequences (4 with --quick) of 32 tokens: its Python, by
    cProfile, and the CUDA calls and kernels, by torch's profiler; their top rows printed."""
    import cProfile
    import pstats

    import torch
    from torch.profiler import ProfilerActivity

    from benchmarks.compare import ordinary_token_ids
    from benchmarks.workloads import WorkloadParams, make_workload
    from liteinfer import LLM, SamplingParams

    llm = LLM(str(model), dtype="bfloat16")
    workload = make_workload("throughput", WorkloadParams(num_prompts=4 if quick else 256, output_len=32),
                             ordinary_token_ids(str(model)))
    prompts = [{"prompt_token_ids": request.prompt_token_ids} for request in workload.requests]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params)
    print(f"{len(prompts)} requests of 32 tokens: {time.perf_counter() - start:.2f} s", flush=True)
    python = cProfile.Profile()
    python.runcall(llm.generate, prompts, params)
    pstats.Stats(python).sort_stats("tottime").print_stats(25)
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
    with torch.profiler.profile(activities=activities) as calls:
        llm.generate(prompts, params)
    print(calls.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    if cuda:
        print(calls.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))


def run(folder: Path, out: Path, quick: bool, budget: float) -> int:
    deadline = time.monotonic() + budget
    site = Path("/tmp/liteinfer-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--upgrade",
                    "--target", str(site), *map(str, (folder / "wheels").glob("*.whl"))], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path.cwd()), str(site)]), PYTHONUNBUFFERED="1",
               LITEINFER_TEST_TOKENIZER=str(folder / "tokenizer"))
    log_path = out / "session.log"  # one log for every step: the device tool brings back at most 8 files
    failures = 0

    def step(name: str, command: list[str], cap: float) -> None:
        """One step, stopped after `cap` seconds or at the session's deadline, whichever comes first; its output goes
        straight into the log, so that a step stopped midway still leaves what it printed."""
        nonlocal failures
        timeout = min(cap, deadline - time.monotonic())
        with open(log_path, "a") as log:
            log.write(f"== {name}: {' '.join(command)}\n")
            log.flush()
            if timeout < MIN_STEP_SECONDS:
                status = "skipped: the session's time is spent"
            else:
                start = time.monotonic()
                try:
                    result = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
                    status = f"exit {result.returncode}"
                except subprocess.TimeoutExpired:
                    status = f"stopped after {timeout:.0f} s"
                except OSError as exc:  # no such program
                    status = f"could not start: {exc}"
                status += f" ({time.monotonic() - start:.0f} s)"
            log.write(f"== {name}: {status}\n")
        print(f"== {name}\n{log_path.read_text()[-2500:]}", flush=True)
        failures += not status.startswith("exit 0")

    step("machine", ["nvidia-smi"], 30)
    step("tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/integration/test_gpu.py",
                   "tests/unit/test_paged_attention_kernel.py", "-k", "cuda or triton"], 240)
    num_prompts = "4" if quick else "256"
    for name, shape in (("smollm2", {}), ("llama-1b", {} if quick else LLAMA_1B)):
        if deadline - time.monotonic() < MIN_STEP_SECONDS:
            break
        model = random_model(folder, Path(f"/tmp/liteinfer-{name}"), **shape)
        if name == "smollm2":
            step("profile", [sys.executable, "-m", "benchmarks.gpu_session", "profile", str(model)]
                 + ["--quick"] * quick, 90)
        step(f"bench-{name}", [sys.executable, "-m", "benchmarks.compare", "--model", str(model), "--engines",
                               ENGINES, "--workloads", "throughput,latency", "--num-prompts", num_prompts,
                               "--output-len", "16" if quick else "128", "--latency-prompts", "2" if quick else "4",
                               "--compare", "transformers-bf16-32", "--output-dir", str(out / name)], 240)
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["prepare", "run", "profile"])
    parser.add_argument("folder", type=Path, help="what prepare writes and run reads (.gpu); profile: the model")
    parser.add_argument("out", type=Path, nargs="?", help="run: where logs and results go ($OUT)")
    parser.add_argument("--quick", action="store_true", help="run: tiny workloads (a dry run of the script on CPU)")
    parser.add_argument("--budget", type=float, default=540, help="run: seconds for all steps; each step is stopped at "
                        "this deadline, and one that would start with less than 30 s left is skipped")
    args = parser.parse_args()
    if args.action == "prepare":
        prepare(args.folder)
    elif args.action == "profile":
        profile(args.folder, args.quick)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        sys.exit(run(args.folder, args.out, args.quick, args.budget))


if __name__ == "__main__":
    main()
