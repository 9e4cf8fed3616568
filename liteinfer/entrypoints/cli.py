"""The `liteinfer` command: `generate` answers prompts, `serve` runs the OpenAI-compatible server, `demo` shows
the default model at work, `models` lists the supported architectures."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from dataclasses import replace

from liteinfer.config import DEFAULT_MODEL
from liteinfer.engine.async_llm import DEFAULT_MAX_WAITING_SEQS
from liteinfer.entrypoints.openai.tool_parsers import TOOL_PARSERS
from liteinfer.llm import LLM
from liteinfer.models import supported_architectures
from liteinfer.outputs import RequestOutput
from liteinfer.sampling import SamplingParams

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing readable Python code.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Name a famous scientist and say what they discovered.",
]


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns 0, or raises SystemExit(2) on bad input, like argparse's own errors."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as error:
        # Bad values and missing files are the user's to fix: a one-line message beats a traceback.
        args.parser.exit(2, f"{args.parser.prog}: error: {error}\n")
    except KeyboardInterrupt:
        return 130


# ------------------------------------------------------------------------------------------------------------
# Subcommands


def _generate(args: argparse.Namespace) -> int:
    # Everything the user typed is validated before the model loads, so a typo fails in milliseconds. The flags left
    # out take the model's recommended sampling (its generation_config.json), as a request without them does.
    given = {name: getattr(args, name) for name in ("temperature", "top_p", "top_k") if getattr(args, name) is not None}
    SamplingParams(**given, max_tokens=args.max_tokens)
    prompts = _read_prompts(args)
    llm = LLM(args.model, **_engine_options(args), seed=args.seed)
    params = replace(llm.get_default_sampling_params(), **given, max_tokens=args.max_tokens)
    # The progress bar goes to stderr: shown to a person at a terminal, kept out of pipes and logs.
    if args.chat:
        conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
        outputs = llm.chat(conversations, params, use_tqdm=sys.stderr.isatty())
    else:
        outputs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())

    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        if args.json:
            print(json.dumps(_as_record(prompt, output), ensure_ascii=False))
            continue
        if len(prompts) > 1:  # a header per answer, since answers may span several lines
            if i > 0:
                print()
            print(f"=== [{i + 1}/{len(prompts)}] {_shorten(prompt)} ===")
        print(output.outputs[0].text)
    failed = [output.error for output in outputs if output.error]
    for error in failed:
        print(f"liteinfer generate: request failed: {error}", file=sys.stderr)
    return 1 if failed else 0


def _demo(args: argparse.Namespace) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)  # checked before the slow load
    start = time.perf_counter()
    llm = LLM(args.model, **_engine_options(args))
    print(f"Loaded {args.model} ({args.dtype}) in {time.perf_counter() - start:.2f} s\n")

    conversations = [[{"role": "user", "content": prompt}] for prompt in DEMO_PROMPTS]
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)  # all prompts in one batch: the engine's main job
    elapsed = time.perf_counter() - start

    for i, (prompt, output) in enumerate(zip(DEMO_PROMPTS, outputs, strict=True)):
        print(f"[{i + 1}] Q: {prompt}")
        print(textwrap.indent(f"A: {output.outputs[0].text.strip()}", "    ") + "\n")
    num_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    print(f"{len(outputs)} requests, {num_tokens} output tokens in {elapsed:.2f} s: "
          f"{num_tokens / elapsed:.1f} output tok/s")
    return 0


def _serve(args: argparse.Namespace) -> int:
    # FastAPI and uvicorn load only for this command, keeping `generate` quick to start.
    from liteinfer.entrypoints.openai.server import serve

    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):  # vLLM asks for both together
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together: give both, or neither")
    serve(args.model, args.host, args.port, api_key=args.api_key, served_model_name=args.served_model_name,
          tool_call_parser=args.tool_call_parser, max_waiting_seqs=args.max_waiting_seqs, **_engine_options(args))
    return 0


def _models(args: argparse.Namespace) -> int:
    for name in supported_architectures():
        print(name)
    return 0


# ------------------------------------------------------------------------------------------------------------
# Helpers


def _read_prompts(args: argparse.Namespace) -> list[str]:
    """Positional prompts (`-` = stdin), then --file; stdin alone when nothing is given and it is piped."""
    lines: list[str] = []
    for prompt in args.prompts:
        if prompt == "-":
            lines += sys.stdin.read().splitlines()
        else:
            lines.append(prompt)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            lines += f.read().splitlines()
    if not args.prompts and not args.file and not sys.stdin.isatty():
        lines += sys.stdin.read().splitlines()
    # Files and pipes are one prompt per line; blank lines are spacing, not empty prompts.
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ValueError("no prompt given: pass PROMPT arguments, --file F, or pipe prompts on stdin")
    return prompts


def _engine_options(args: argparse.Namespace) -> dict:
    options = dict(dtype=args.dtype, device=args.device)
    for name in ("revision", "tokenizer", "tokenizer_revision", "max_model_len", "max_num_seqs", "quantization",
                 "kv_cache_dtype", "enforce_eager", "generation_config", "tensor_parallel_size", "data_parallel_size",
                 "ray_address", "speculative_config"):
        if getattr(args, name, None) is not None:  # unset: leave the engine's own default
            options[name] = getattr(args, name)
    return options


def _as_record(prompt: str, output: RequestOutput) -> dict:
    completion = output.outputs[0]
    return {
        "prompt": prompt,
        "text": completion.text,
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
        "num_prompt_tokens": len(output.prompt_token_ids),
        "num_output_tokens": len(completion.token_ids),
        "error": output.error,
    }


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is expected, got {text}")
    return value


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number in 0-65535, got {port}")
    return port


def _shorten(text: str, width: int = 60) -> str:
    return textwrap.shorten(text, width, placeholder="...")


# ------------------------------------------------------------------------------------------------------------
# Parser


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="liteinfer", description="A small, readable LLM inference engine.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser(
        "generate", help="complete or answer prompts",
        description="Complete (or with --chat, answer) each prompt and print the result.",
    )
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="a prompt; '-' reads prompts from stdin")
    gen.add_argument("--file", "-f", help="read prompts from a file, one per line")
    gen.add_argument("--chat", action="store_true", help="send each prompt as a user message (chat template)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _add_model_args(gen, default_dtype="auto")
    _add_batching_args(gen)
    sampling = gen.add_argument_group("sampling")
    # Longer than SamplingParams' 16: a command-line user wants a whole answer.
    sampling.add_argument("--max-tokens", type=int, default=128, help="most tokens per answer (default: 128)")
    # Unset: the model's recommended value (--generation-config), else SamplingParams'.
    sampling.add_argument("--temperature", type=float,
                          help=f"0 = greedy (default: the model's, else {SamplingParams.temperature})")
    sampling.add_argument("--top-p", type=float, help=f"(default: the model's, else {SamplingParams.top_p})")
    sampling.add_argument("--top-k", type=int, help=f"0 = off (default: the model's, else {SamplingParams.top_k})")
    sampling.add_argument("--seed", type=int, default=0,
                          help="sampling seed; the same seed repeats a run (default: 0)")
    gen.set_defaults(run=_generate, parser=gen)

    demo = commands.add_parser("demo", help="answer a batch of chat prompts and report throughput",
                               description="Answer a batch of chat prompts greedily and report throughput.")
    _add_model_args(demo, default_dtype="bfloat16")  # the fastest dtype on CPU
    demo.add_argument("--max-tokens", type=int, default=64, help="most tokens per answer (default: 64)")
    demo.set_defaults(run=_demo, parser=demo)

    serve = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                                description="Serve the model over an OpenAI-compatible HTTP API (see README).")
    _add_model_args(serve, default_dtype="auto")
    _add_batching_args(serve)
    serve.add_argument("--max-waiting-seqs", type=int, default=DEFAULT_MAX_WAITING_SEQS,
                       help="queued sequences past which requests get 503 (default: %(default)s)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=_port, default=8000, help="(default: %(default)s)")
    # From the environment by default: a key on the command line shows in `ps`.
    serve.add_argument("--api-key", default=os.environ.get("LITEINFER_API_KEY"),
                       help="require `Authorization: Bearer KEY` (default: $LITEINFER_API_KEY; none: open)")
    serve.add_argument("--served-model-name", help="the model's name in the API (default: --model)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let requests with tools use tool_choice "auto" (needs --tool-call-parser)')
    serve.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                       help="how the model writes its tool calls: hermes (Hermes, Qwen 2.5/3), llama3_json "
                            "(Llama 3.1/3.2)")
    serve.set_defaults(run=_serve, parser=serve)

    models = commands.add_parser("models", help="list the supported model architectures")
    models.set_defaults(run=_models, parser=models)
    return parser


def _add_batching_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, help="most requests decoded together")


def _add_model_args(parser: argparse.ArgumentParser, default_dtype: str) -> None:
    parser.add_argument("--model", "-m", default=DEFAULT_MODEL,
                        help="model directory, .gguf file or Hub id (default: %(default)s)")
    parser.add_argument("--revision", help="a Hub model's branch, tag or commit (default: its main branch)")
    parser.add_argument("--tokenizer", help="the tokenizer's directory, .gguf file or Hub id (default: the model's)")
    parser.add_argument("--tokenizer-revision", help="the tokenizer's branch, tag or commit on the Hub")
    parser.add_argument("--dtype", default=default_dtype, choices=["auto", "float32", "bfloat16", "float16"],
                        help="weight and activation dtype (default: %(default)s)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="(default: auto)")
    parser.add_argument("--quantization", choices=["int8", "int4"], help="weight-only quantization (CPU)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "int8"],
                        help="int8: the K/V cache in bytes, each row at its own scale (CPU; default: auto, the "
                             "model's dtype)")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction,
                        help="--no-enforce-eager runs decode steps as torch.compile graphs, compiled at start-up "
                             "(about 60 s for SmolLM2 on 2 CPU cores); default: eager")
    parser.add_argument("--speculative-config", type=_json_object,
                        help='speculative decoding by prompt lookup, as vLLM\'s: \'{"method": "ngram", '
                             '"num_speculative_tokens": 3, "prompt_lookup_max": 4}\' (default: off)')
    parser.add_argument("--generation-config",
                        help="where requests' default sampling comes from: auto (the model's "
                             "generation_config.json), vllm (none: SamplingParams' defaults) or a directory holding "
                             "one (default: auto)")
    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--tensor-parallel-size", "-tp", type=int,
                          help="shard the model over this many processes (CUDA: devices) on this host")
    parallel.add_argument("--data-parallel-size", "-dp", type=int,
                          help="run this many engine replicas as Ray actors (needs the `ray` extra)")
    parallel.add_argument("--ray-address", help="the Ray cluster to join (default: start a local one)")


if __name__ == "__main__":
    sys.exit(main())
