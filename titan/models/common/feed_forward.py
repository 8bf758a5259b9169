"""The SwiGLU feed-forward of a dense block."""

from torch import Tensor, nn

from titan.models.common.swiglu import silu_gate


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), the gate fused (titan/models/common/swiglu.py)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(silu_gate(self.w1(x), self.w3(x)))
