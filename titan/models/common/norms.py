"""RMSNorm as every family uses it."""

import torch.nn.functional as F
from torch import Tensor, nn


def two_step_rms_norm(x: Tensor, normalized_shape: tuple[int, ...], weight: Tensor | None, eps: float | None) -> Tensor:
    """Normalise in fp32, round to x's dtype, then scale by the weight, as Meta's reference does: two roundings."""
    normed = F.rms_norm(x.float(), normalized_shape, eps=eps).type_as(x)
    return normed if weight is None else normed * weight


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm that accumulates in fp32 whatever the input dtype: the mean of squares over dim in bf16 loses too
    many bits.

    Where the weight has the input's dtype (fp32 training, and bf16 under FSDP's mixed precision), one F.rms_norm
    call: CUDA runs it as one fused kernel (fp32 inside, the output rounded once), the CPU as its composite (the
    input upcast, one rounding at the end), where scaling a bf16 normalisation by the weight apart took four
    kernels and two fp32 round trips in forward, recompute and backward. Under autocast the weight stays fp32 while
    activations are bf16: two_step_rms_norm."""

    def forward(self, x: Tensor) -> Tensor:
        if self.weight is None or self.weight.dtype == x.dtype:
            return F.rms_norm(x, self.normalized_shape, self.weight, eps=self.eps)
        return two_step_rms_norm(x, self.normalized_shape, self.weight, self.eps)
