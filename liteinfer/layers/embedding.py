"""Token embedding and the LM head that maps hidden states back to vocabulary logits, both split over
tensor-parallel ranks by vocabulary rows.

Each rank holds ceil(vocab / ranks) consecutive rows (the last rank's tail is padding). The embedding looks up the
tokens whose rows it holds, zeroes the others, and the ranks' results are summed (all-reduce); the LM head
computes the logits of its rows, and rank 0 gathers them side by side (the other ranks get None). A head held whole
can also give each row's greedy token without computing all its logits (`greedy_tokens`, layers/greedy_head.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from liteinfer.distributed import TensorParallelGroup
from liteinfer.layers.greedy_head import ScreenedArgmax
from liteinfer.layers.linear import linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup | None = None):
        super().__init__()
        self.tp = tp or TensorParallelGroup()
        self.vocab_size = vocab_size
        rows = -(-vocab_size // self.tp.size)
        self.vocab_start = self.tp.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.load_weight

    def load_weight(self, param: nn.Parameter, loaded) -> None:
        if tuple(loaded.shape) != (self.vocab_size, param.shape[1]):
            raise ValueError(f"expected shape {(self.vocab_size, param.shape[1])}, got {tuple(loaded.shape)}")
        held = max(0, min(param.shape[0], self.vocab_size - self.vocab_start))
        param.data[:held].copy_(loaded.narrow(0, self.vocab_start, held))
        param.data[held:].zero_()  # padding rows: never looked up, their logits are cut off

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.weight.shape[0])
        hidden = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return self.tp.all_reduce(hidden.masked_fill_(elsewhere[:, None], 0))


class LMHead(nn.Module):
    """Logits for the given hidden states (on rank 0; None on the others); a tied head shares the embedding's
    Parameter, split the same way (until quantized or prepacked: then the head holds a copy of its own)."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None,
                 tp: TensorParallelGroup | None = None):
        super().__init__()
        self.tp = tp or TensorParallelGroup()
        self.vocab_size = vocab_size
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            rows = -(-vocab_size // self.tp.size)
            self.vocab_start = self.tp.rank * rows
            self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
            self.weight.weight_loader = self.load_weight
        self.quantized: Callable[[torch.Tensor], torch.Tensor] | None = None  # as in Linear
        self.screened: ScreenedArgmax | None = None  # set by `screen_greedy`

    load_weight = VocabEmbedding.load_weight  # the same rows of the same [vocab, hidden] layout

    def screen_greedy(self) -> None:
        """Prepare `greedy_tokens` where it pays: a float head packed for our kernel, held whole by this rank, on a
        CPU that the screen's build serves (layers/greedy_head.py)."""
        if self.screened is None and self.tp.size == 1 and ScreenedArgmax.takes(self.weight):
            self.screened = ScreenedArgmax(self.weight, self.vocab_size)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's greedy token, the argmax that `forward`'s logits would give, where `screen_greedy` prepared it
        and the logits are finite; None otherwise (compute the logits)."""
        return None if self.screened is None else self.screened(hidden, self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.quantized(hidden) if self.quantized is not None else linear(hidden, self.weight)
        logits = self.tp.gather_last_dim(logits)
        return None if logits is None else logits[:, : self.vocab_size]
