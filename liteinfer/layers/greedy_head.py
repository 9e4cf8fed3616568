"""The greedy tokens of an fp32 LM head from its logits in bf16, and the fp32 logits of a few candidates only.

An fp32 head is the largest single matmul of a small model's decode step (SmolLM2: 49,152 x 576, 113 MB, a fifth of
an fp32 step's linears), and a greedy step needs only each row's largest logit. The same head in bf16 runs in half
the time (half the bytes, twice the multiplies a cycle); its logits a~ differ from the fp32 ones L by at most a bound
e that is known per row r and token j, so only the tokens whose interval [a~ - e, a~ + e] reaches the largest lower
end of the row can hold its largest fp32 logit. Those candidates' fp32 logits are computed by the same kernel, on W's
rows for them alone, which gives every token the bits it has in the full head (a row's sum over the inputs does not
depend on the outputs beside it: tests/unit/test_greedy_head.py); the first of their largest is the token the full
head's argmax gives, ties included, since every other token is strictly below some candidate.

The bound, for x a row of hidden states and w_j a row of W (x' and w'_j rounded to bf16; norms Euclidean; K inputs):
  L_j = x.w_j to within g |x||w_j|, its fp32 sum's rounding (g = K 2^-23 / (1 - K 2^-23), twice the worst case of
        one rounding an addition);
  x.w_j - x'.w'_j = (x - x').w_j + x'.(w_j - w'_j), at most |x - x'||w_j| + |x'||w_j - w'_j|;
  the bf16 head's own fp32 sum of x'.w'_j: within g |x'||w'_j| <= g |x'| (|w_j| + |w_j - w'_j|);
  its output rounded to bf16: within 2^-8 |a~_j|.
So e_j = |w_j| (|x - x'| + g (|x| + |x'|)) + |w_j - w'_j| |x'| (1 + g) + 2^-8 |a~_j|, widened by a margin for the
rounding of these terms themselves (`_MARGIN`, and an absolute term far above any subnormal the tiles flush). On
SmolLM2's hidden states a row keeps one candidate on the median, three at the 90th percentile, 21 at most (768 rows
of 16 prompts; docs/benchmarks.md).

Where: heads whose W our packed linear multiplies in fp32 (CPUs with AVX-512 BF16, which multiply bf16 natively),
held whole by one rank (`screen_greedy`), for steps whose every row takes the plain argmax (engine/model_runner.py).
It costs a bf16 copy of W (half the fp32 head's memory). A step whose bf16 logits are not all finite falls back to
the full head, as does one that leaves more than half the vocabulary as candidates.
"""

from __future__ import annotations

import torch
from torch import nn

from liteinfer.layers.linear import linear, pack_weight, packed_rows, unpack_weight

_ROUNDING = 2.0**-23  # twice fp32's unit roundoff: a bound for any one rounding of a sum, however the tiles round
_OUTPUT_ROUNDING = 2.0**-8  # bf16's unit roundoff: the bf16 head's outputs
_MARGIN = 1 + 2.0**-10  # the bound's own terms, computed in fp64 and fp32, widened by this
_ABSOLUTE = 1e-6  # added to every bound: far above what flushed subnormals can change
_CHUNK_ROWS = 4096  # W's rows at a time when its norms are computed in fp64


class ScreenedArgmax(nn.Module):
    """Each row's greedy token of an fp32 head W (packed by `pack_weight`), from a bf16 copy and a few fp32 rows."""

    def __init__(self, weight: torch.Tensor, vocab_size: int):
        super().__init__()
        plain = unpack_weight(weight)  # with its padding rows, if any: they make whole blocks of 16 outputs
        self.vocab_size = vocab_size
        self.register_buffer("weight_bf16", pack_weight(plain.bfloat16()))
        norms = []
        for rows in plain[:vocab_size].split(_CHUNK_ROWS):
            rows = rows.double()
            norms.append(torch.stack([rows.norm(dim=1), (rows - rows.bfloat16().double()).norm(dim=1)]))
        # [2, vocab]: each row's |w_j| and |w_j - w'_j|, widened so that fp32 holds no less than the fp64 value.
        self.register_buffer("vocab_terms", (torch.cat(norms, dim=1) * _MARGIN).float().contiguous())

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        """Whether W is an fp32 head packed for our kernel, which then multiplies bf16 natively too."""
        return weight is not None and weight.dim() == 4 and weight.dtype == torch.float32

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """hidden [rows, in] fp32 -> each row's first largest fp32 logit's token [rows] (int64), as
        argmax(linear(hidden, weight)) gives it; None when some bf16 logit is not finite (hidden's NaN and infinities
        included), which the bound cannot take, or when more than half the vocabulary stays a candidate (logits so
        alike that only a degenerate model gives them)."""
        candidates = self.candidates(hidden)
        # None found (a logit not finite), or so many that copying their rows would cost more than the full head.
        if not 0 < len(candidates) <= self.vocab_size // 2:
            return None
        exact = linear(hidden, packed_rows(weight, candidates))[:, : len(candidates)]
        # Candidates ascend, so the first of a row's largest is the full head's first too.
        return candidates[torch.ops.liteinfer.argmax(exact)]

    def candidates(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tokens, ascending, that can hold some row's largest fp32 logit; none when a bf16 logit is not finite."""
        rounded = hidden.bfloat16()
        approx = linear(rounded, self.weight_bf16)[:, : self.vocab_size].contiguous()
        return torch.ops.liteinfer.head_candidates(approx, self._row_terms(hidden, rounded), self.vocab_terms,
                                                   _OUTPUT_ROUNDING * _MARGIN)

    @staticmethod
    def _row_terms(hidden: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
        """[rows, 3] fp32: what multiplies |w_j|, what multiplies |w_j - w'_j|, and the absolute term (see above)."""
        x, x_rounded = hidden.double(), rounded.double()
        inputs = hidden.shape[1]
        sum_rounding = inputs * _ROUNDING / (1 - inputs * _ROUNDING)
        norm, norm_rounded = x.norm(dim=1), x_rounded.norm(dim=1)
        terms = torch.stack([
            (x - x_rounded).norm(dim=1) + sum_rounding * (norm + norm_rounded),
            norm_rounded * (1 + sum_rounding),
            torch.full_like(norm, _ABSOLUTE),
        ], dim=1)
        return (terms * _MARGIN).float()

