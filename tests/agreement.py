"""Greedy agreement of a lossy engine option (int8 weights, int8 K/V pools) with the plain engine: the tokens
generated before the first divergence, and where each divergence falls on the reference's logits. Rounding alone
flips a model's near-ties, so such options are held to near-ties, not to identity."""

import functools

from liteinfer import LLM, SamplingParams

CHAT_QUESTIONS = ["What is the capital of France?", "Write a haiku about the ocean.", "What is 12 times 7?",
                  "Explain photosynthesis in simple terms.", "Translate 'good morning' into Spanish.",
                  "List three tips for staying productive.", "Why is the sky blue?", "Name a famous painter."]
# The slow agreement tests' SmolLM2 runs: every question as a chat, 48 greedy tokens each.
CONVERSATIONS = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]
PARAMS = SamplingParams(temperature=0, max_tokens=48, min_tokens=48, ignore_eos=True)
BUDGET = {"kv_cache_memory_bytes": 512 << 20}


def chat_tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.chat(CONVERSATIONS, PARAMS)]


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), None)


def tokens_matched(reference: list[list[int]], candidate: list[list[int]]) -> int:
    """Tokens generated before each sequence's first divergence, summed."""
    divergences = [first_divergence(r, c) for r, c in zip(reference, candidate)]
    return sum(len(r) if d is None else d for r, d in zip(reference, divergences))


def departure_gaps(reference: LLM, prompts: list[list[int]], reference_tokens: list[list[int]],
                   candidate_tokens: list[list[int]]) -> list[float]:
    """At each sequence's first divergence, how far the candidate's token lies below the reference's choice in the
    reference's logits (the reference run one step on the common history); its token must be in their top 20."""
    gaps = []
    for prompt, theirs, ours in zip(prompts, reference_tokens, candidate_tokens):
        d = first_divergence(ours, theirs)
        if d is None:
            continue
        step = SamplingParams(temperature=0, max_tokens=1, logprobs=20)  # logprobs: from the raw logits
        top = reference.generate([{"prompt_token_ids": prompt + theirs[:d]}], step)[0].outputs[0].logprobs[0]
        assert ours[d] in top, f"token {ours[d]} chosen outside the reference's top 20, at new token {d}"
        gaps.append(top[theirs[d]].logprob - top[ours[d]].logprob)
    return gaps


@functools.cache
def references() -> tuple[LLM, list[list[int]], list[list[int]]]:
    """The plain fp32 engine, its tokens for CONVERSATIONS and bf16's: made once a session, for every agreement test
    (each engine's load and run takes tens of seconds)."""
    reference = LLM(**BUDGET, dtype="float32")
    return reference, chat_tokens(reference), chat_tokens(LLM(**BUDGET, dtype="bfloat16"))


def assert_agrees_with_fp32_as_closely_as_bf16(candidate: list[list[int]], label: str, near_tie: float) -> int:
    """`candidate`: a lossy option's tokens for CONVERSATIONS under PARAMS. It must keep at least half of bf16's
    agreement with the plain fp32 engine (tokens before the first divergence), each of its first divergences at a
    near-tie of the fp32 logits (a gap under `near_tie`). Returns how many prompts it kept identical."""
    reference, fp32, bf16 = references()
    matched, bf16_matched = tokens_matched(fp32, candidate), tokens_matched(fp32, bf16)
    identical = sum(first_divergence(s, t) is None for s, t in zip(fp32, candidate))
    print(f"tokens before the first divergence from fp32 (of {sum(map(len, fp32))}): {label} {matched} ({identical} "
          f"of {len(fp32)} prompts identical), bf16 {bf16_matched}")
    assert matched >= 0.5 * bf16_matched

    prompts = [reference.apply_chat_template(conversation) for conversation in CONVERSATIONS]
    gaps = departure_gaps(reference, prompts, fp32, candidate)
    print(f"fp32 logit gaps where {label} departs: {[round(g, 3) for g in gaps]}")
    assert all(gap < near_tie for gap in gaps), gaps
    return identical
