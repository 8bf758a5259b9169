"""QuantizedLinear: the nn.Linear shell that every low-precision converter's linear shares. Subclasses supply
`matmul`, the (tokens, in_features) @ weight^T product with their own quantization and autograd."""

import torch
from torch import Tensor, nn


class QuantizedLinear(nn.Linear):
    """nn.Linear whose matmuls a subclass runs in low precision; parameters stay in high precision for the
    optimizer, and FQNs, shapes and state dicts are those of the nn.Linear it replaced."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options) -> "QuantizedLinear":
        """A `cls` sharing `linear`'s parameters (works on the meta device); `options` go to cls.__init__."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, **options)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def matmul(self, x_2d: Tensor) -> Tensor:
        """x_2d (tokens, in_features) @ weight^T, differentiable in both."""
        raise NotImplementedError(f"{type(self).__name__} must implement matmul")

    def forward(self, x: Tensor) -> Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            # Autocast would not reach inside the subclass's autograd.Function: apply its dtype to the input here.
            x = x.to(torch.get_autocast_dtype(device_type))
        with torch.autocast(device_type, enabled=False):
            x_2d = x.reshape(-1, x.shape[-1])  # (tokens, in_features)
            out = self.matmul(x_2d)
            out = out.reshape(*x.shape[:-1], out.shape[-1])  # (..., out_features)
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
        return out
