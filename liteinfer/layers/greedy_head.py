"""A float LM head's greedy tokens from logits in bytes, and the exact logits of a few candidates only.

The head is the largest single matmul of a small model's decode step (SmolLM2: 49,152 x 576, a fifth of a step's
linears), and a greedy step needs only each row's largest logit. The screen (`torch.ops.liteinfer.head_screen`)
multiplies bytes: x's row rounded to uint8 levels, W's rows to int8 levels (one scale a token), so that vpdpbusd takes
64 products an instruction, twice what bf16 pairs take, over half a bf16 head's bytes. Its logits a differ from the
head's own by at most a bound e, known per row and token, so only the tokens whose interval [a - e, a + e] reaches the
largest lower end of the row can hold its largest logit. Those candidates' logits are computed by the head's own
kernel on W's rows for them alone, which gives every token the bits it has in the full head (a row's sum over the
inputs does not depend on the outputs beside it: tests/unit/test_greedy_head.py); the first of their largest is the
token the full head's argmax gives, ties included, since every other token is strictly below some candidate.

A model's final hidden states carry a few dims far above the rest (SmolLM2: |x| ~52, of which one dim ~36 and another
~16): rounded with them, every other input would lose its levels. So the `OUTLIER_DIMS` dims with the largest |x| so
far (summed over the rows of the 1st, 2nd, 4th, 8th ... call) are left out of x's levels and multiplied in bf16 pairs
against W's columns for them (both exact in a bf16 model). Which dims they are changes how many candidates a row
keeps, never its token.

The bound, for x a row of hidden states (x_R: x with the outlier dims zeroed, x'_R its levels times its scale; x_O the
outlier dims, x'_O rounded to bf16), w_j a row of W (w'_j: its levels times its scale; its outlier columns rounded to
bf16 off by at most r_w |w_j|, r_w = 2^-8 for an fp32 head, 0 for a bf16 one), K inputs, D outlier dims, norms
Euclidean:
  the head's own logit v_j, an fp32 sum of K products, lies within g_K |x||w_j| of x.w_j (g_n = n 2^-23 / (1 - n
        2^-23): twice the worst case of n roundings);
  x.w_j minus the screen's products is (x_R - x'_R).w_j + x'_R.(w_j - w'_j) + (x_O - x'_O).w_j + x'_O.(the outlier
        columns' rounding), at most |x_R - x'_R||w_j| + |x'_R||w_j - w'_j| + |x_O - x'_O||w_j| + r_w |x'_O||w_j|;
  the screen's own roundings (the byte sum converted, scaled twice, two per pair of outlier dims): within g_{D+4}
        (|x'_R| (|w_j| + |w_j - w'_j|) + (1 + r_w) |x'_O||w_j|).
So e_j = |w_j| (|x_R - x'_R| + |x_O - x'_O| + r_w |x'_O| + g_K |x| + g_{D+4} (|x'_R| + (1 + r_w) |x'_O|))
+ |w_j - w'_j| |x'_R| (1 + g_{D+4}), widened by a margin for the rounding of these terms themselves (and an absolute
term far above any subnormal the tiles flush). A bf16 head's logits are then rounded to bf16 (relative error r =
2^-8), which may tie two of them: the interval is widened to (1 + r) e_j + r |a_j| on both sides, so that a token left
out rounds strictly below a candidate. On SmolLM2 a 32-row step keeps 42 candidates on the median in bf16 and 84 in
fp32 (docs/benchmarks.md).

Where: heads whose W our packed linear multiplies (fp32 and bf16 on CPUs with AVX-512 BF16; the screen needs VNNI),
held whole by one rank (`screen_greedy`), for steps whose every row takes the plain argmax (engine/model_runner.py);
not bf16 heads on CPUs with AMX, whose tiles multiply bf16 faster than vpdpbusd multiplies bytes (not measured there).
It costs W's levels (a quarter of an fp32 head's memory, half a bf16 one's), its outlier columns in bf16, and the
fp32 logits of its largest step's rows (rounded up to a power of two; SmolLM2 at 256 rows: 50 MB). A step whose
hidden states are not all finite, or so large that a screened logit could overflow (~1e38), falls back to the full
head, as does one that leaves more than half the vocabulary as candidates.
"""

from __future__ import annotations

import torch
from torch import nn

from liteinfer import huge_pages, kernels
from liteinfer.layers.linear import linear, packed_entries, packed_rows, unpack_weight

OUTLIER_DIMS = 32  # x's dims left out of its levels: on SmolLM2, 16 left a tenth of the rows with 18+ candidates
_BLOCK = 64  # tokens a block of the screen's layout
_OUTPUT_ROUNDING = 2.0**-8  # bf16's unit roundoff: a bf16 head's outputs
_MARGIN = 1 + 2.0**-10  # the bound's own terms, computed in fp64 and fp32, widened by this
_CHUNK_ROWS = 4096  # W's rows at a time when its levels and norms are computed in fp64
_MAX_INPUTS = 65536  # a row's byte sum, at most inputs * 255 * 127, stays within int32


class ScreenedArgmax(nn.Module):
    """Each row's greedy token of a float head W (packed by `pack_weight`), from W's levels and a few exact rows."""

    def __init__(self, weight: torch.Tensor, vocab_size: int):
        super().__init__()
        plain = unpack_weight(weight)
        self.vocab_size = vocab_size
        # A bf16 head's logits are rounded to bf16; an fp32 head's outlier columns are, in the screen.
        bf16 = weight.dtype == torch.bfloat16
        self.relative = _OUTPUT_ROUNDING * _MARGIN if bf16 else 0.0
        self.weight_rounding = 0.0 if bf16 else _OUTPUT_ROUNDING * _MARGIN
        levels, scales, norms = [], [], []
        for rows in plain[:vocab_size].split(_CHUNK_ROWS):
            rows = rows.double()
            scale = (rows.abs().amax(dim=1) / 127).float().double()  # the fp32 scale the screen multiplies by
            scale[scale == 0] = 1
            level = (rows / scale[:, None]).round().clamp(-127, 127)
            levels.append(level.to(torch.int8))
            scales.append(scale.float())
            norms.append(torch.stack([rows.norm(dim=1), (rows - level * scale[:, None]).norm(dim=1)]))
        level = torch.cat(levels)
        padding = -vocab_size % _BLOCK
        level = torch.cat([level, level.new_zeros(padding, level.shape[1])])
        # Plain tensors, not buffers: derived from the head, they are no weights of the model (whose buffers key the
        # compiled decode step's packages, engine/packaged.py).
        self.levels = level.view(-1, _BLOCK, level.shape[1] // 4, 4).transpose(1, 2).contiguous()
        self.level_scales = torch.cat([*scales, torch.ones(padding)])
        # x's levels are x + 128 (unsigned, as vpdpbusd takes them): each token's sum then carries 128 times its own.
        self.level_offsets = (level.int().sum(dim=1) * 128).int()
        # [2, vocab]: each row's |w_j| and |w_j - w'_j|, widened so that fp32 holds no less than the fp64 value.
        self.vocab_terms = (torch.cat(norms, dim=1) * _MARGIN).float().contiguous()
        # [2, blocks]: the largest of each block's |w_j| and |w_j - w'_j|, over its tokens in the vocabulary.
        blocks = torch.cat([self.vocab_terms, self.vocab_terms[:, -1:].expand(2, padding)], dim=1)  # the last again
        self.block_terms = blocks.view(2, -1, _BLOCK).amax(dim=2).contiguous()
        # W's largest level scale, which bounds every screened logit (the kernel declines rows that could overflow).
        self.largest_scale = float(self.level_scales[:vocab_size].max())
        self.dim_sums = torch.zeros(plain.shape[1], dtype=torch.float64)
        self.outlier_dims = torch.empty(0, dtype=torch.long)
        self.outlier_weights = torch.empty(level.shape[0] // _BLOCK, 0, _BLOCK, 2, dtype=torch.bfloat16)
        # Where the screen writes its logits, kept between calls: a fresh [rows, tokens] tensor each call (50 MB at
        # 256 rows) is mapped anew by the allocator and its pages faulted in as the tiles write them, which took a
        # 243-row call from ~21 ms to ~37 (docs/benchmarks.md).
        self.logits = torch.empty(0, level.shape[0], dtype=torch.float32)
        self.calls = 0

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        """Whether W is a float head packed for our kernel on a CPU that the screen's build serves, and not a bf16
        head that multiplies in AMX tiles (which take bf16 several times faster than vpdpbusd takes bytes)."""
        if not (weight is not None and weight.dim() == 4 and weight.dtype in (torch.float32, torch.bfloat16)
                and kernels.head_screen_available()):
            return False
        inputs = weight.shape[1] * weight.shape[3]
        if inputs % 4 or inputs > _MAX_INPUTS:
            return False
        return weight.dtype == torch.float32 or not torch.ops.liteinfer.packed_linear_amx()

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """hidden [rows, in] -> each row's first largest logit's token [rows] (int64), as argmax(linear(hidden,
        weight)) gives it; None when some hidden state is not finite or large enough for a screened logit to overflow,
        which the bound cannot take, or when more than half the vocabulary stays a candidate (logits so alike that only
        a degenerate model gives them)."""
        candidates = self.candidates(hidden, weight)
        # None found (a value not finite), or so many that copying their rows would cost more than the full head.
        if not 0 < len(candidates) <= self.vocab_size // 2:
            return None
        exact = linear(hidden, packed_rows(weight, candidates))[:, : len(candidates)]
        # Candidates ascend, so the first of a row's largest is the full head's first too.
        return candidates[torch.ops.liteinfer.argmax(exact)]

    def candidates(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The tokens, ascending, that can hold some row's largest logit; none when a value is not finite."""
        hidden = hidden.contiguous()
        self.calls += 1
        if self.calls & (self.calls - 1) == 0:  # a power of two
            self._choose_outlier_dims(hidden, weight)
        return torch.ops.liteinfer.head_screen(
            hidden, self.outlier_dims, self.levels, self.level_scales, self.level_offsets, self.outlier_weights,
            self.vocab_terms, self.block_terms, self.logits_for(len(hidden)), self.relative, self.weight_rounding,
            self.largest_scale)

    def logits_for(self, rows: int) -> torch.Tensor:
        """The screen's logits workspace with room for `rows` rows, on huge pages, grown to the next power of two."""
        if len(self.logits) < rows:
            tokens = self.logits.shape[1]
            rows = 1 << (rows - 1).bit_length()
            self.logits = huge_pages.empty(rows * tokens * 4).view(torch.float32).view(rows, tokens)
        return self.logits

    def _choose_outlier_dims(self, hidden: torch.Tensor, weight: torch.Tensor) -> None:
        """The OUTLIER_DIMS dims with the largest |x| summed so far, and W's columns for them in bf16, in pairs of dims
        for blocks of 64 tokens."""
        self.dim_sums += hidden.double().abs().nan_to_num(posinf=0).sum(dim=0)
        dims = self.dim_sums.topk(min(OUTLIER_DIMS, len(self.dim_sums))).indices.sort().values  # even: in % 4 == 0
        if torch.equal(dims, self.outlier_dims):
            return
        blocks = self.levels.shape[0]
        columns = packed_entries(weight, torch.arange(min(blocks * _BLOCK, weight.shape[0] * 16)), dims).bfloat16()
        columns = torch.cat([columns, columns.new_zeros(blocks * _BLOCK - len(columns), len(dims))])
        self.outlier_dims = dims
        self.outlier_weights = columns.view(blocks, _BLOCK, len(dims) // 2, 2).transpose(1, 2).contiguous()
