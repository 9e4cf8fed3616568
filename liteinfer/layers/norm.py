"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from liteinfer import kernels


class RMSNorm(nn.Module):
    gemma = False  # GemmaRMSNorm's weight form (for the kernel)

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32, then back to the activation dtype before the weight, as the reference models do
        # (the order matters for bit-level agreement in bf16).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if kernels.pointwise_takes(x) and self.weight.dtype == x.dtype:  # one pass instead of seven ops
            rows = x.reshape(-1, x.shape[-1]).contiguous()  # (q and k heads arrive as views into q/k/v's rows)
            if residual is None:
                return torch.ops.liteinfer.rms_norm(rows, self.weight, self.eps, self.gemma).view(x.shape)
            residual = residual.reshape(rows.shape).contiguous()
            out, total = torch.ops.liteinfer.add_rms_norm(rows, residual, self.weight, self.eps, self.gemma)
            return out.view(x.shape), total.view(x.shape)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class GemmaRMSNorm(RMSNorm):
    """Gemma's variant: the checkpoint stores the scale as an offset from 1, and it is applied in fp32 before the
    cast back (the reference's order, which matters in bf16)."""

    gemma = True

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)
