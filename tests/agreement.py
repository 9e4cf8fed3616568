"""Greedy agreement of a lossy engine option (int8 weights, int8 K/V pools) with the plain engine: the tokens
generated before the first divergence, and where each divergence falls on the reference's logits. Rounding alone
flips a model's near-ties, so such options are held to near-ties, not to identity."""

from liteinfer import LLM, SamplingParams

CHAT_QUESTIONS = ["What is the capital of France?", "Write a haiku about the ocean.", "What is 12 times 7?",
                  "Explain photosynthesis in simple terms.", "Translate 'good morning' into Spanish.",
                  "List three tips for staying productive.", "Why is the sky blue?", "Name a famous painter."]


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
