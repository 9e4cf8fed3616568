import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from liteinfer.sampling import NO_TOKEN, Sampler, SamplerOutput, SamplingParams, SamplingRow
from liteinfer.sampling.sampler import apply_min_p, apply_penalties, apply_top_k, apply_top_p, seeded_uniform

EOS = 0
NEG_INF = -float("inf")


def make_row(prompt=(), output=(), seed=None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), [*prompt, *output], len(prompt), seed)


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(eos_token_ids={EOS})


@pytest.fixture(autouse=True)
def _fixed_global_seed():
    # Unseeded rows use the global RNG; pin it so a statistical test cannot flake.
    torch.manual_seed(1234)


def sample_counts(sampler: Sampler, logits: torch.Tensor, num: int, **params) -> torch.Tensor:
    """Samples `num` times from one row of logits (as one batch) and counts each token."""
    rows = [make_row(**params) for _ in range(num)]
    out = sampler(logits.expand(num, -1), rows)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[-1])


def test_sampler_greedy_rows_take_argmax(sampler):
    logits = torch.randn(8, 100)
    out = sampler(logits, [make_row(temperature=0.0) for _ in range(8)])
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8 and out.top_logprobs == [None] * 8


def test_sampler_top_k_1_equals_greedy(sampler):
    logits = torch.randn(16, 200)
    out = sampler(logits, [make_row(temperature=1.5, top_k=1) for _ in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_sampler_top_k_never_samples_outside_top_k(sampler):
    logits = torch.randn(50) * 0.5
    counts = sample_counts(sampler, logits, 4000, top_k=5)
    top5 = set(logits.topk(5).indices.tolist())
    assert set(counts.nonzero().flatten().tolist()) == top5


def test_sampler_top_p_samples_only_the_nucleus(sampler):
    logits = logits_from_probs([0.5, 0.3, 0.1, 0.06, 0.04])
    # Mass before token 2 is 0.8 >= 0.75, so the nucleus is {0, 1}.
    counts = sample_counts(sampler, logits, 4000, top_p=0.75)
    assert set(counts.nonzero().flatten().tolist()) == {0, 1}


def test_apply_top_k_keeps_k_largest_per_row():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    out = apply_top_k(logits.clone(), torch.tensor([1, 3]))
    assert (out > NEG_INF).tolist() == [[True, False, False, False], [False, True, True, True]]


def test_apply_top_p_keeps_smallest_set_reaching_top_p():
    logits = logits_from_probs([0.1, 0.4, 0.2, 0.3]).expand(3, -1).clone()
    out = apply_top_p(logits.clone(), torch.tensor([0.65, 0.05, 0.99]))
    assert (out > NEG_INF).tolist() == [
        [False, True, False, True],  # 0.4 + 0.3 reaches 0.65
        [False, True, False, False],  # the top token always stays
        [True, True, True, True],
    ]
    assert torch.equal(out[2], logits[2])


def test_apply_top_p_after_top_k_measures_renormalised_mass():
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1])[None]
    # Over the full vocab 0.4 < 0.5 would keep token 1; within top_k=2 token 0 alone holds 4/7.
    out = apply_top_p(apply_top_k(logits.clone(), torch.tensor([2])), torch.tensor([0.5]))
    assert (out > NEG_INF).tolist() == [[True, False, False, False]]


@pytest.mark.parametrize(
    "scales",
    [
        [6.0, 8.0],  # peaked rows: every nucleus lies within the first candidates looked at
        [0.01, 0.5, 3.0, 8.0],  # flat rows push some nucleus far beyond them: the search widens
    ],
)
def test_apply_top_p_matches_full_sort_reference(scales):
    vocab = 3000
    logits = torch.randn(len(scales), vocab) * torch.tensor(scales)[:, None]
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.3][: len(scales)])
    out = apply_top_p(logits.clone(), top_p)
    for row, p, kept in zip(logits, top_p, out > NEG_INF, strict=True):
        probs, order = row.softmax(-1).sort(descending=True)
        num_kept = int(((probs.cumsum(-1) - probs) < p).sum())
        assert set(kept.nonzero().flatten().tolist()) == set(order[:num_kept].tolist())


def test_apply_min_p_drops_tokens_below_scaled_max():
    logits = logits_from_probs([0.5, 0.2, 0.04, 0.26])[None]
    out = apply_min_p(logits.clone(), torch.tensor([0.1]))
    assert (out > NEG_INF).tolist() == [[True, True, False, True]]


def test_sampler_min_p_never_samples_below_threshold(sampler):
    logits = logits_from_probs([0.5, 0.2, 0.04, 0.26])
    counts = sample_counts(sampler, logits, 4000, min_p=0.1)
    assert counts[2] == 0 and (counts[[0, 1, 3]] > 0).all()


def test_apply_penalties_changes_logits_as_specified():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]])
    row = make_row(
        prompt=[0, 4],
        output=[1, 1, 2],
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    out = apply_penalties(logits.clone(), [row])
    expected = [
        2.0 / 2,  # prompt only: repetition divides a positive logit
        -1.0 * 2 - 0.25 * 2 - 0.5,  # output twice: repetition multiplies a negative logit, then both
        0.5 / 2 - 0.25 - 0.5,
        3.0,  # never seen
        -0.5 * 2,  # prompt only: presence and frequency ignore the prompt
    ]
    assert out[0].tolist() == pytest.approx(expected)


def test_apply_penalties_rows_are_independent():
    logits = torch.zeros(2, 3) + 1.0
    rows = [make_row(output=[2, 2, 2], frequency_penalty=1.0), make_row(output=[1], presence_penalty=-1.0)]
    out = apply_penalties(logits, rows)
    assert out.tolist() == [[1.0, 1.0, -2.0], [1.0, 2.0, 1.0]]


def test_sampler_penalty_only_on_some_rows_leaves_others_and_input_untouched(sampler):
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    original = logits.clone()
    rows = [make_row(output=[1], temperature=0, repetition_penalty=2.0), make_row(output=[1], temperature=0)]
    out = sampler(logits, rows)
    assert out.token_ids == [2, 1]  # 3/2 < 2 on the penalised row only
    assert torch.equal(logits, original)


def test_sampler_min_tokens_blocks_eos_and_stop_tokens_until_reached(sampler):
    logits = torch.tensor([[10.0, 9.0, 0.0, 1.0]]).expand(3, -1)
    rows = [
        make_row(output=[3], temperature=0, min_tokens=2, stop_token_ids=[1]),
        make_row(output=[3, 3], temperature=0, min_tokens=2, stop_token_ids=[1]),
        make_row(output=[3], temperature=0.8, min_tokens=2, stop_token_ids=[1]),
    ]
    for _ in range(20):
        out = sampler(logits, rows)
        assert out.token_ids[0] == 3
        assert out.token_ids[1] == EOS
        assert out.token_ids[2] in (2, 3)


def test_sampler_seeded_row_same_tokens_in_any_batch(sampler):
    vocab, steps = 1000, 8
    target = torch.randn(vocab)

    def run(seed, position, others):
        tokens = []
        for _ in range(steps):
            rows = [make_row(**p) for p in others]
            rows.insert(position, SamplingRow(SamplingParams(top_p=0.95, seed=seed), list(tokens), 0, seed))
            logits = torch.randn(len(rows), vocab)
            logits[position] = target
            tokens.append(sampler(logits, rows).token_ids[position])
        return tokens

    alone = run(seed=7, position=0, others=[])
    # Other rows force different code paths: greedy, top_k alone, their own seed, the global RNG.
    crowded = run(seed=7, position=2, others=[{"temperature": 0}, {"top_k": 3}, {"seed": 8}, {"min_p": 0.2}])
    assert alone == crowded
    assert run(seed=9, position=0, others=[]) != alone


def test_sampler_temperature_matches_softmax_distribution(sampler):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    num, temperature = 20_000, 0.7
    counts = sample_counts(sampler, logits, num, temperature=temperature)
    expected = torch.softmax(logits / temperature, -1)
    standard_error = (expected * (1 - expected) / num).sqrt()
    assert ((counts / num - expected).abs() < 4.5 * standard_error).all(), (counts / num, expected)


def test_seeded_rows_follow_the_distribution_across_seeds_and_positions(sampler):
    """A seeded row's draw is a function of (seed, position): over many seeds, and over the positions of one seed's
    sample, its tokens still follow softmax(logits / T)."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    temperature, num = 0.7, 20_000
    expected = torch.softmax(logits / temperature, -1)
    standard_error = (expected * (1 - expected) / num).sqrt()
    across_seeds = [make_row(seed=seed, output=[1] * 5, temperature=temperature) for seed in range(num)]
    across_positions = [make_row(seed=11, output=[1] * n, temperature=temperature) for n in range(num)]
    for rows in (across_seeds, across_positions):
        tokens = sampler(logits.expand(num, -1), rows).token_ids
        counts = torch.bincount(torch.tensor(tokens), minlength=len(expected))
        assert ((counts / num - expected).abs() < 4.5 * standard_error).all(), (counts / num, expected)


def test_seeded_uniform_is_a_function_of_seed_and_position_in_the_unit_interval():
    draws = [seeded_uniform(seed, position) for seed in (0, 1, -5, 2**63 - 1) for position in range(2_000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert draws == [seeded_uniform(seed, position) for seed in (0, 1, -5, 2**63 - 1) for position in range(2_000)]
    assert len(set(draws)) > 0.99 * len(draws)  # 24-bit draws: a few collisions at most
    # Neighbouring positions and seeds are not correlated: a linear fit of each draw on the one before explains
    # nothing.
    pairs = torch.tensor(draws).view(-1, 2)
    assert abs(torch.corrcoef(pairs.T)[0, 1]) < 0.05
    bins = torch.histc(torch.tensor(draws), bins=10, min=0, max=1) / len(draws)
    assert ((bins - 0.1).abs() < 0.015).all(), bins


def test_sampler_logprobs_come_from_raw_logits_with_ranks(sampler):
    logits = torch.tensor(
        [
            [2.0, 1.0, 0.0, 3.0, -1.0],
            [2.0, 1.0, 0.0, 3.0, -1.0],
            [2.0, 1.0, 0.0, 3.0, -1.0],
        ]
    )
    rows = [
        make_row(output=[3], temperature=0, logprobs=2, repetition_penalty=4.0),
        make_row(temperature=0),
        make_row(temperature=0.5, logprobs=0, frequency_penalty=1.0, output=[0]),
    ]
    out = sampler(logits, rows)
    raw = torch.log_softmax(logits[0], -1)

    # The penalty turns the argmax into token 0, but the logprobs stay the raw model's.
    assert out.token_ids[0] == 0
    assert out.logprobs[0] == pytest.approx(raw[0].item())
    top = out.top_logprobs[0]
    assert list(top) == [0, 3]  # sampled token first; it is also the 2nd most likely
    assert top[3].rank == 1 and top[3].logprob == pytest.approx(raw[3].item())
    assert top[0].rank == 2 and top[0].decoded_token is None

    assert out.logprobs[1] is None and out.top_logprobs[1] is None

    token = out.token_ids[2]
    assert out.logprobs[2] == pytest.approx(raw[token].item())
    assert out.top_logprobs[2] == {token: out.top_logprobs[2][token]}
    assert out.top_logprobs[2][token].rank == 1 + int((raw > raw[token]).sum())


def test_sampler_logprobs_tied_tokens_share_rank(sampler):
    logits = torch.tensor([[1.0, 1.0, 0.0, 1.0]], dtype=torch.bfloat16)
    out = sampler(logits, [make_row(temperature=0, logprobs=4)])
    top = out.top_logprobs[0]
    assert sorted(top) == [0, 1, 2, 3]
    assert [top[t].rank for t in range(4)] == [1, 1, 4, 1]
    assert math.exp(out.logprobs[0]) == pytest.approx(math.exp(1) / (3 * math.exp(1) + 1))


def test_sampler_mixed_batch_greedy_and_sampled_rows(sampler):
    logits = torch.randn(6, 300)
    original = logits.clone()
    rows = [
        make_row(temperature=0),
        make_row(top_k=1),
        make_row(temperature=0, top_k=5, top_p=0.1),  # greedy ignores truncation
        make_row(seed=3, top_k=4),
        make_row(temperature=2.0, top_p=0.5, logprobs=1),
        make_row(temperature=1e-6),
    ]
    out = sampler(logits, rows)
    argmax = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 1, 2, 5)] == [argmax[i] for i in (0, 1, 2, 5)]
    assert out.token_ids[3] in logits[3].topk(4).indices.tolist()
    assert out.token_ids[4] in out.top_logprobs[4]
    assert [lp is None for lp in out.logprobs] == [True, True, True, True, False, True]
    assert torch.equal(logits, original)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    stop_ids=st.lists(st.integers(1, 31), max_size=3),
    num_output=st.integers(0, 3),
)
def test_sampler_greedy_below_min_tokens_is_the_masked_argmax(seed, dtype, stop_ids, num_output):
    """The unedited greedy path (argmax of the raw logits, masking only when it hits a stop token) picks what an
    argmax over a masked fp32 copy picks, and leaves the caller's logits as they were."""
    sampler = Sampler(eos_token_ids={EOS})
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(seed)).to(dtype)
    logits[:, [EOS, *stop_ids]] += 3  # make the stop tokens likely argmaxes
    original = logits.clone()
    rows = [make_row(output=[5] * num_output, temperature=0, min_tokens=2, stop_token_ids=stop_ids) for _ in range(4)]
    out = sampler(logits, rows)
    expected = logits.to(torch.float32, copy=True)
    if num_output < 2:
        expected[:, [EOS, *stop_ids]] = NEG_INF
    assert out.token_ids == expected.argmax(-1).tolist()
    assert torch.equal(logits, original)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), stop_ids=st.lists(st.integers(1, 31), max_size=3), num_output=st.integers(0, 3))
def test_from_argmax_is_the_sampler_on_the_logits(seed, stop_ids, num_output):
    """Rows that take their logits' argmax, given it (as a screened head gives it): the tokens a call on the logits
    gives, the logits asked for only for rows whose argmax they may not sample yet."""
    sampler = Sampler(eos_token_ids={EOS})
    logits = torch.randn(6, 32, generator=torch.Generator().manual_seed(seed))
    logits[:3, [EOS, *stop_ids]] += 3  # the first rows' argmax likely a stop token
    rows = [make_row(output=[5] * num_output, temperature=0, min_tokens=2, stop_token_ids=stop_ids) for _ in range(6)]
    assert Sampler.takes_argmax(rows)
    asked = []

    def logits_of(indices: list[int]) -> torch.Tensor:
        asked.append(indices)
        return logits[indices]

    argmax = logits.argmax(-1).tolist()
    out = sampler.from_argmax(argmax, rows, logits_of)
    assert out == sampler(logits, rows)
    held_back = [i for i, token in enumerate(argmax) if num_output < 2 and token in [EOS, *stop_ids]]
    assert asked == ([held_back] if held_back else [])


def test_takes_argmax_only_for_plain_greedy_rows():
    assert Sampler.takes_argmax([make_row(temperature=0), make_row(temperature=0, min_tokens=4, ignore_eos=True)])
    for params in (dict(temperature=0.7), dict(temperature=0, logprobs=2), dict(temperature=0, presence_penalty=0.5)):
        assert not Sampler.takes_argmax([make_row(temperature=0), make_row(**params)])


def banned_row(output=(), bad_words_token_ids=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(output), 0, bad_words_token_ids=bad_words_token_ids)


def test_sampler_logit_bias_moves_greedy_and_sampled_rows_but_not_logprobs(sampler):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]]).expand(3, -1)
    original = logits.clone()
    rows = [
        make_row(temperature=0, logit_bias={0: 5.0}, logprobs=0),
        make_row(temperature=0, logit_bias={1: -1.5}),  # 1.5 < 2: token 2 wins
        make_row(temperature=1.0, logit_bias={1: -100.0, 2: -100.0, 3: -100.0}),
    ]
    for _ in range(20):
        out = sampler(logits, rows)
        assert out.token_ids == [0, 2, 0]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(original[0], -1)[0].item())  # the model's, unbiased
    assert torch.equal(logits, original)


def test_sampler_allowed_token_ids_keep_only_those(sampler):
    logits = torch.randn(60)
    allowed = logits.argsort()[:4].tolist()  # the four least likely tokens
    greedy = sampler(logits[None], [make_row(temperature=0, allowed_token_ids=allowed)])
    assert greedy.token_ids == [max(allowed, key=lambda t: logits[t].item())]
    counts = sample_counts(sampler, logits, 2000, allowed_token_ids=allowed, top_k=3)
    kept = sorted(allowed, key=lambda t: -logits[t].item())[:3]  # top_k counts among the allowed tokens only
    assert set(counts.nonzero().flatten().tolist()) == set(kept)


def test_sampler_bad_words_ban_a_last_token_only_after_its_prefix(sampler):
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 6.0, 1.0]])
    words = [[4], [2, 1]]  # token 4 always; token 1 right after a generated 2
    assert sampler(logits, [banned_row([7, 2], words, temperature=0)]).token_ids == [2]
    assert sampler(logits, [banned_row([2, 7], words, temperature=0)]).token_ids == [1]
    # The prefix is matched against the generated tokens only, as vLLM does: a prompt ending in 2 leaves 1 allowed.
    row = SamplingRow(SamplingParams(temperature=0), [2], 1, bad_words_token_ids=words)
    assert sampler(logits, [row]).token_ids == [1]
    for _ in range(20):  # sampled rows too
        tokens = sampler(logits.expand(2, -1), [banned_row([2], words), banned_row([], words)]).token_ids
        assert tokens[0] not in (1, 4) and tokens[1] != 4


def test_takes_argmax_not_for_rows_whose_logits_a_request_edits():
    edited = (dict(logit_bias={1: 1.0}), dict(allowed_token_ids=[1, 2]))
    for params in edited:
        assert not Sampler.takes_argmax([make_row(temperature=0), make_row(temperature=0, **params)])
    assert not Sampler.takes_argmax([make_row(temperature=0), banned_row([], [[3]], temperature=0)])


def test_a_row_whose_constraints_exclude_every_token_gets_no_token(sampler):
    """Its request fails alone (the engine's): a greedy argmax would give token 0 and a draw any token, both outside
    what the request allows."""
    logits = torch.randn(3, 8)
    rows = [banned_row([], [[3]], temperature=0, allowed_token_ids=[3], logprobs=1),
            banned_row([], [[3]], allowed_token_ids=[3]),
            banned_row([], [[3]], temperature=0, allowed_token_ids=[3, 5])]
    out = sampler(logits, rows)
    assert out.token_ids == [NO_TOKEN, NO_TOKEN, 5]
