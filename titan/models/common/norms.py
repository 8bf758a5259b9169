"""RMSNorm as every family uses it."""

import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm that normalises in fp32 and scales in the input dtype, as Meta's reference does:
    the mean of squares over dim in bf16 loses too many bits."""

    def forward(self, x: Tensor) -> Tensor:
        normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps).type_as(x)
        return normed * self.weight
