"""Adam and AdamW with their moments stored in bfloat16 (--optimizer.state_dtype bfloat16): 4 bytes of optimizer
state per parameter instead of 8, the parameters themselves staying float32.

Each step reads a parameter's moments up to float32, runs torch's Adam(W) update there (the same formulas and order
as torch.optim.AdamW's for-loop kernel), and writes the moments back with stochastic rounding: a value between two
bfloat16 neighbours becomes the upper one with probability proportional to its distance from the lower one, so the
stored moment is the exact one in expectation. With round-to-nearest, an increment under half of bfloat16's spacing
(2^-9 of the value) is lost every time: with beta2 = 0.999 the second moment moves by 0.1% of itself per step and
would stay frozen wherever gradients change slowly.

The random bits are a hash of (element index in the shard, the parameter's step count, the parameter's index, which
moment), computed on the device, not drawn from a generator: every rank that holds the same values (a parameter
replicated over tensor-parallel ranks) rounds them identically, as a replicated parameter must stay identical; a
resume continues the same bits from the step counts in the checkpoint; nothing is read on the host.

The update of each parameter is one torch.compile'd function (one fused kernel instead of some twenty passes over
the shard; dynamic shapes and learning rates, so it compiles a few times per process); the dry run's fake tensors
take it uncompiled. Skipped updates (--training.on_nonfinite, --training.on_spike) are decided on the device, as for
torch's fused Adam: while the trainer sets `found_inf`, a non-zero value leaves the parameters, moments and step
counts bit for bit as they were, whatever the gradients hold (a skipped step's are often NaN or inf).
"""

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from titan.parallel.shards import local_shard, matching_layout

MASK_32 = 0xFFFFFFFF


def hash_32(values: Tensor) -> Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds with the constant 0x45d9f3b) of int64 tensors holding
    32-bit values; the products stay below 2^59, so int64 arithmetic never overflows."""
    for _ in range(2):
        values = (((values >> 16) ^ values) * 0x45D9F3B) & MASK_32
    return (values >> 16) ^ values


def rounding_keys(step: Tensor, param_index: int) -> Tensor:
    """(2,) int64 on the step's device: one key per moment for the rounding bits of the step numbered `step`."""
    moments = torch.arange(2, device=step.device, dtype=torch.int64)
    return hash_32(hash_32(step.long() * 2 + moments) ^ ((param_index * 0x9E3779B9) & MASK_32))


def rounding_bits(numel: int, key: Tensor) -> Tensor:
    """16 uniform random bits per element of a flat shard, a function of (element, key) alone."""
    return (hash_32(torch.arange(numel, device=key.device, dtype=torch.int64) ^ key) & 0xFFFF).int()


def round_with(values: Tensor, random_bits: Tensor) -> Tensor:
    """float32 -> bfloat16, away from zero where `random_bits` are below the 16 dropped bits: with probability
    (the dropped bits) / 2^16 for uniform random bits."""
    bits = values.view(torch.int32)
    toward_zero = bits & -0x10000  # the upper 16 bits: sign, exponent and bfloat16's 7 mantissa bits
    rounded = torch.where(random_bits < (bits & 0xFFFF), toward_zero + 0x10000, toward_zero)
    return rounded.view(torch.float32).bfloat16()


def adam_update(weights: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor, apply: Tensor,
                keys: Tensor, lr: Tensor, weight_decay: Tensor, beta1: float, beta2: float, eps: float,
                decoupled: bool) -> None:
    """torch's single-tensor Adam(W) step on one flat shard, in place, where `apply` (a 0-dim bool) is set; the
    moments computed in float32 and stored stochastically rounded, with `keys` (rounding_keys), when they are
    bfloat16. Where `apply` is not set, weights, moments and step count keep their bits: the update is computed and
    then not selected, never scaled by zero, since a skipped step's gradients are non-finite and NaN times 0 is NaN."""
    new_step = step + 1
    decayed = weights * (1 - lr * weight_decay) if decoupled else weights
    if not decoupled:
        grad = grad + weights * weight_decay
    new_exp_avg = exp_avg.float().lerp(grad, 1 - beta1)
    new_exp_avg_sq = exp_avg_sq.float().lerp(grad * grad, 1 - beta2)
    step_size = lr / (1 - beta1 ** new_step)
    denom = new_exp_avg_sq.sqrt() / (1 - beta2 ** new_step).sqrt() + eps
    weights.copy_(torch.where(apply, decayed.addcdiv(new_exp_avg * step_size, denom, value=-1), weights))
    step.copy_(torch.where(apply, new_step, step))
    for moment, (state, value) in enumerate(((exp_avg, new_exp_avg), (exp_avg_sq, new_exp_avg_sq))):
        if state.dtype == torch.bfloat16:
            value = round_with(value, rounding_bits(value.numel(), keys[moment]))
        state.copy_(torch.where(apply, value, state))


@functools.cache
def compiled_adam_update() -> Callable[..., None]:
    """adam_update compiled, built on first use: torch.compile imports dynamo and inductor, about a second of the
    start-up of every process, which runs without bfloat16 optimizer state need not pay."""
    return torch.compile(adam_update, dynamic=True, fullgraph=True)


class BF16StateAdam(torch.optim.Optimizer):
    """Adam (decoupled=False) or AdamW (decoupled=True) with bfloat16 moments and float32 step counts."""

    skips_on_found_inf = True
    """The trainer may set `found_inf` (a 0-dim float on the device) before step(): non-zero skips the update."""

    def __init__(self, params: Iterable[dict[str, Any]], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, decoupled: bool, state_dtype: torch.dtype = torch.bfloat16,
                 compiled: bool = True) -> None:
        """`state_dtype` float32 stores the moments unrounded: the same update as torch's Adam(W), to test against.
        `compiled`: the update as one compiled kernel per parameter; off where tensors have no values to run kernels
        on (the dry run's fake tensors)."""
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.decoupled = decoupled
        self.state_dtype = state_dtype
        self.compiled = compiled
        self.register_load_state_dict_post_hook(BF16StateAdam.restore_state_dtype)

    @staticmethod
    def restore_state_dtype(optimizer: "BF16StateAdam") -> None:
        """torch's Optimizer.load_state_dict casts every floating-point state to its parameter's dtype (float32):
        back to the moments' dtype, exactly, as they were saved from it."""
        for state in optimizer.state.values():
            for name in ("exp_avg", "exp_avg_sq"):
                if name in state:
                    state[name] = state[name].to(optimizer.state_dtype)

    def state_of(self, param: Tensor) -> dict[str, Tensor]:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=local_shard(param).device)
            state["exp_avg"] = torch.zeros_like(param, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.state_dtype)
        return state

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        found_inf = getattr(self, "found_inf", None)
        params = [(group, param) for group in self.param_groups for param in group["params"]]
        for param_index, (group, param) in enumerate(params):
            if param.grad is None:
                continue
            state = self.state_of(param)
            # flat views of the (contiguous) shards: one compiled kernel for every shape and rank of tensor
            weights = local_shard(param).view(-1)
            grad = local_shard(matching_layout(param.grad, param)).view(-1).float()
            exp_avg, exp_avg_sq = local_shard(state["exp_avg"]).view(-1), local_shard(state["exp_avg_sq"]).view(-1)
            # whether to apply the update: a flag on the device, never read on the host
            apply = torch.ones((), dtype=torch.bool, device=weights.device) if found_inf is None else found_inf == 0
            update = compiled_adam_update() if self.compiled else adam_update
            # keyed by the step count the update will have: a skipped step's bits go unused and come at the next one
            keys = rounding_keys(state["step"] + 1, param_index)
            # The rates as 0-dim device tensors (a fill kernel each, no copy from the host): as Python floats the
            # compiled function would specialize on their first values, and which of its variants served a step
            # would depend on the run's history, so a resumed run could round differently from the one it continues.
            lr, weight_decay = (torch.full((), group[name], device=weights.device) for name in ("lr", "weight_decay"))
            update(weights, grad, exp_avg, exp_avg_sq, state["step"], apply, keys, lr=lr, weight_decay=weight_decay,
                   beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"], decoupled=self.decoupled)
