"""Speculative decoding on real chat text, where the harness's workloads cannot go: they force every output's length
on random token ids, which loop SmolLM2's greedy output (an upper bound for prompt lookup). Here each engine answers
the same chat prompts greedily until the model's own end of turn (at most `--max-tokens`), one request at a time and
all at once, plain and with prompt lookup; the answers must be equal token for token.

    .venv/bin/python -m benchmarks.speculative_chat --dtype bfloat16 --speculative '{"num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from liteinfer import LLM, SamplingParams
from liteinfer.entrypoints.cli import DEMO_PROMPTS

# Answers that quote their prompt (corrections, rewrites, repeated lists, code redone) beside the demo's questions.
QUOTING_PROMPTS = [
    "Fix the spelling in this sentence and write it out: 'The quick brwn fox jumpd over the lazy dog near the rivr.'",
    "Repeat this list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes, honeydew.",
    "Rewrite in the passive voice: The committee approved the budget. The mayor signed the law. The city hired "
    "ten new teachers.",
    "Write a Python function that adds two numbers, then write the same function again with type hints.",
    "Put these words in alphabetical order: zebra, apple, mango, kiwi, banana, cherry, lemon.",
    "Change every 'cat' to 'dog' in this text: The cat sat. The cat ate. The cat slept on the cat bed.",
]


def run(llm: LLM, conversations: list, params: SamplingParams, one_at_a_time: bool) -> tuple[list, float]:
    start = time.perf_counter()
    if one_at_a_time:
        outputs = [llm.chat([conversation], params)[0] for conversation in conversations]
    else:
        outputs = llm.chat(conversations, params)
    return outputs, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--speculative", default='{"num_speculative_tokens": 4}', help="speculative_config, JSON")
    parser.add_argument("--rounds", type=int, default=2, help="timed passes of each form; the best is reported")
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    groups = {"demo questions": list(DEMO_PROMPTS), "quoting prompts": QUOTING_PROMPTS}
    engines = {"plain": LLM(dtype=args.dtype), "speculative": LLM(dtype=args.dtype,
                                                                  speculative_config=json.loads(args.speculative))}
    print("| prompts | requests | engine | output tok/s | output tokens | drafts kept / computed (a pass) |\n"
          "|---|---|---|---|---|---|")
    for group, prompts in groups.items():
        conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
        for one_at_a_time in (True, False):
            answers = {}
            for name, llm in engines.items():
                llm.chat(conversations[:2], replace(params, max_tokens=8))  # warm-up
                before = llm.engine.stats()
                best = min((run(llm, conversations, params, one_at_a_time) for _ in range(args.rounds)),
                           key=lambda result: result[1])
                after = llm.engine.stats()
                outputs, seconds = best
                answers[name] = [out.outputs[0].token_ids for out in outputs]
                num_tokens = sum(map(len, answers[name]))
                kept = (after.spec_accepted_tokens - before.spec_accepted_tokens) // args.rounds
                drafted = (after.spec_draft_tokens - before.spec_draft_tokens) // args.rounds
                mode = "one at a time" if one_at_a_time else "all at once"
                print(f"| {group} ({len(prompts)}) | {mode} | {name} | {num_tokens / seconds:.1f} | {num_tokens} | "
                      f"{kept} / {drafted} |", flush=True)
            assert answers["plain"] == answers["speculative"], "speculative decoding changed an answer"


if __name__ == "__main__":
    main()
