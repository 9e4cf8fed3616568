"""Shared-prefix workload: requests that share a long system prompt, with prefix caching on and off, in one run.

    .venv/bin/python -m benchmarks.prefix_caching [--requests 32] [--prefix-tokens 1000] [--max-tokens 16]

Prints a markdown table (time to first token p50/p99, total time, output tok/s per configuration) and writes the
numbers as JSON under benchmarks/results/. Both configurations run in this process, one after the other, each
after a warm-up request; chunked prefill keeps its default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.metrics import percentile
from benchmarks.record import provenance, result_stem
from liteinfer import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?", "How do bees make honey?", "Why is the sea salty?", "What is a prime number?",
    "Who wrote Hamlet?", "How far is the Moon?", "What is photosynthesis?", "Why do cats purr?",
]


def system_prompt(llm: LLM, num_tokens: int) -> str:
    """A system prompt of about `num_tokens` tokens (a numbered list of house rules)."""
    rules, text = [], ""
    while len(llm.tokenizer.encode(text)) < num_tokens:
        rules.append(f"Rule {len(rules) + 1}: answer politely, briefly and accurately, and cite the facts you use.")
        text = " ".join(rules)
    return text


def run(model: str, dtype: str, caching: bool, num_requests: int, prefix_tokens: int, max_tokens: int) -> dict:
    llm = LLM(model, dtype=dtype, enable_prefix_caching=caching)
    system = system_prompt(llm, prefix_tokens)
    conversations = [
        [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}]
        for i in range(num_requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    llm.chat([[{"role": "user", "content": "Hello"}]], params)  # warm-up, on a prompt that shares nothing
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    total = time.perf_counter() - start
    ttfts = [out.metrics.first_token_time - out.metrics.arrival_time for out in outputs]
    return {
        "prefix_caching": caching,
        "prompt_tokens": statistics.mean(len(out.prompt_token_ids) for out in outputs),
        "cached_tokens": statistics.mean(out.num_cached_tokens for out in outputs),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "total_s": total,
        "output_tok_s": sum(len(out.outputs[0].token_ids) for out in outputs) / total,
        "tokens": [out.outputs[0].token_ids for out in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    results = [run(args.model, args.dtype, caching, args.requests, args.prefix_tokens, args.max_tokens)
               for caching in (False, True)]
    # In bf16 the two paths may round differently and flip near-tie tokens; the tests prove equality in fp32.
    same_tokens = sum(a == b for a, b in zip(results[0].pop("tokens"), results[1].pop("tokens")))
    record = {"workload": vars(args), **provenance(), "same_greedy_tokens": same_tokens, "results": results}
    result_stem("prefix_caching").with_suffix(".json").write_text(json.dumps(record, indent=2))

    print(f"{args.requests} requests, ~{results[0]['prompt_tokens']:.0f}-token prompts sharing a "
          f"{args.prefix_tokens}-token system prompt, {args.max_tokens} output tokens each, {args.dtype}; "
          f"revision {record['revision']}; identical greedy outputs: {same_tokens}/{args.requests}\n")
    print("| prefix caching | cached tokens / request | TTFT p50 | TTFT p99 | total | output tok/s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {'on' if r['prefix_caching'] else 'off'} | {r['cached_tokens']:.0f} | {r['ttft_p50_s']:.2f} s | "
              f"{r['ttft_p99_s']:.2f} s | {r['total_s']:.2f} s | {r['output_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
