"""The mixture-of-experts feed-forward (Qwen3-MoE's and DeepSeek-V3's): a token-choice top-k router over SwiGLU
experts (softmax scores, or DeepSeek-V3's sigmoid scores with group-limited choice and scaled weights), shared experts
that every token passes through, the experts' grouped matmuls, and the two ways of keeping experts evenly loaded (a
load-balancing loss, and DeepSeek-V3's auxiliary-loss-free bias).

Tokens are sorted by expert before the experts run, so each expert's tokens are one contiguous block of rows and
the experts' matmuls are one grouped matmul (`torch._grouped_mm`) where the device has it. A later stage may
exchange those blocks between ranks (expert parallel replaces `moe.experts`); the router and the combine stay here.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan.models.common.feed_forward import FeedForward
from titan.models.common.swiglu import silu_gate


@dataclass(frozen=True)
class TokenCounts:
    """How the experts learn, on the host, how many tokens each expert got, for the ops that take sizes (one matmul
    per expert where grouped matmuls don't run, expert parallel's all-to-all splits). The trainer's experts read them
    from the device; the dry run injects `even` ones (set_token_counts)."""

    even: bool = False
    """Take the counts as an even spread of the tokens over the experts, the balance the router is trained towards,
    instead of reading them: the dry run's fake tensors carry no values. torch._grouped_mm then runs only where its
    shape rule allows it (bf16)."""

    def read(self, counts: Tensor, total: int) -> list[int] | list[list[int]]:
        """counts (a 1-D tensor adding up to `total`, or 2-D with every row adding up to it) as Python ints, in one
        read."""
        if not self.even:
            return counts.tolist()
        share, extra = divmod(total, counts.size(-1))
        row = [share + (i < extra) for i in range(counts.size(-1))]
        return row if counts.dim() == 1 else [list(row) for _ in range(counts.size(0))]


READ_COUNTS = TokenCounts()


def grouped_mm_supported(x: Tensor, token_counts: TokenCounts = READ_COUNTS) -> bool:
    """Whether torch._grouped_mm runs for x's device and dtype: on CUDA from Hopper (SM90) in bf16, which is what
    its CUDA kernels take; on the CPU in any float dtype, but compiled or with even `token_counts` (fake tensors,
    whose ops run the shape rule alone) only in bf16, since torch 2.13's shape rule for the op asks for bf16 whatever
    the device."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return x.device.type == "cpu" and (x.dtype == torch.bfloat16
                                       or not (torch.compiler.is_compiling() or token_counts.even))


def matmul_dtype(x: Tensor) -> torch.dtype:
    """The dtype a matmul of x runs in: autocast's where it is on (it does not cover torch._grouped_mm, so the
    experts cast as it would), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


GroupedLinear = Callable[[Tensor, str], Tensor]
"""linear(h, name): each expert's block of rows of h times its weight `name` (experts, out, in) transposed, plus its
bias `name`_bias (experts, out) where the experts have one -> (rows, out)."""


class ExpertFunction(Protocol):
    """An expert's math over its tokens, written with `linear` (GroupedLinear) for its matmuls and elementwise ops
    between them: x (rows, dim) -> (rows, dim). It must map a zero row to a zero row: low-precision matmuls run it on
    blocks padded with zero rows (titan/quant/grouped.py) whose products must stay zero."""

    def __call__(self, x: Tensor, linear: GroupedLinear) -> Tensor: ...


def swiglu_expert(x: Tensor, linear: GroupedLinear) -> Tensor:
    """SwiGLU, w2(silu(w1 x) * w3 x): Qwen3-MoE's and DeepSeek-V3's experts."""
    return linear(silu_gate(linear(x, "w1"), linear(x, "w3")), "w2")


class ExpertMatmuls(Protocol):
    """How GroupedExperts run their matmuls: x (tokens, dim) sorted by expert with counts (num_experts,), the experts'
    parameters by name, their function, and how counts reach the host -> (tokens, dim). A model converter
    (titan/quant) swaps in low-precision ones; expert parallel keeps whichever the experts had."""

    def __call__(self, x: Tensor, counts: Tensor, params: Mapping[str, Tensor], function: ExpertFunction,
                 token_counts: TokenCounts) -> Tensor: ...


def expert_of_rows(counts: Tensor, num_rows: int) -> Tensor:
    """(num_rows,) int64: the expert of each row of a block-sorted layout with counts (experts,) rows per expert."""
    return torch.repeat_interleave(torch.arange(counts.size(0), device=counts.device), counts, output_size=num_rows)


@dataclass(frozen=True)
class HighPrecisionMatmuls:
    """The experts' matmuls in the weights' (or autocast's) dtype: one grouped matmul (torch._grouped_mm) per weight
    where the device has it, else one matmul per expert on block sizes read on the host (a graph break under
    compile). Experts may get no rows."""

    def __call__(self, x: Tensor, counts: Tensor, params: Mapping[str, Tensor], function: ExpertFunction,
                 token_counts: TokenCounts) -> Tensor:
        dtype = matmul_dtype(x)
        x = x.to(dtype)
        if grouped_mm_supported(x, token_counts):
            offsets = counts.cumsum(0).to(torch.int32)  # where each expert's block ends

            def linear(h: Tensor, name: str) -> Tensor:
                # _grouped_mm multiplies block i of h by matrix i of an (experts, in, out) tensor: the weight
                # transposed.
                out = torch._grouped_mm(h, params[name].to(dtype).transpose(-2, -1), offs=offsets)
                bias = params.get(f"{name}_bias")
                return out if bias is None else out + bias.to(dtype)[expert_of_rows(counts, h.size(0))]
        else:
            sizes = token_counts.read(counts, x.size(0))

            def linear(h: Tensor, name: str) -> Tensor:
                weight, bias = params[name].to(dtype), params.get(f"{name}_bias")
                return torch.cat([F.linear(rows, weight[e], None if bias is None else bias[e].to(dtype))
                                  for e, rows in enumerate(h.split(sizes))])
        return function(x, linear)


class GroupedExperts(nn.Module):
    """num_experts experts as stacked parameters by name, one matmul per weight over every expert: weights w1, w3
    (experts, hidden, dim) and w2 (experts, dim, hidden), with `bias` also w1_bias, w3_bias (experts, hidden) and
    w2_bias (experts, dim), and `function` (SwiGLU unless given) computing with them. Kernels, expert parallel, FSDP
    and the converters read the parameters by name (`weight_names`)."""

    weight_names = ("w1", "w2", "w3")
    """The matmuls' weights, each (experts, out, in); `<name>_bias` is its bias where the experts have biases."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, bias: bool = False,
                 function: ExpertFunction = swiglu_expert) -> None:
        super().__init__()
        self.num_experts, self.dim, self.hidden_dim = num_experts, dim, hidden_dim
        self.function = function
        self.matmuls: ExpertMatmuls = HighPrecisionMatmuls()
        self.token_counts = READ_COUNTS
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        if bias:
            for name in self.weight_names:
                weight = getattr(self, name)
                self.register_parameter(f"{name}_bias", nn.Parameter(torch.empty(num_experts, weight.size(1))))

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """x (tokens, dim) sorted by expert, counts (num_experts,): each expert's rows -> (tokens, dim)."""
        return self.matmuls(x, counts, dict(self.named_parameters(recurse=False)), self.function, self.token_counts)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, matmuls={self.matmuls}"


def set_token_counts(model: nn.Module, token_counts: TokenCounts) -> None:
    """Make every set of experts in `model` learn its token counts as `token_counts` says (the dry run's even ones)."""
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.token_counts = token_counts


@dataclass(frozen=True)
class MoEArgs:
    """The mixture-of-experts feed-forward of a block: num_experts SwiGLU experts of hidden_dim units, of
    which each token's router picks top_k."""

    num_experts: int
    top_k: int
    hidden_dim: int
    """Hidden units of one expert (HF's moe_intermediate_size)."""
    norm_topk_prob: bool = True
    """Rescale a token's top_k routing weights to sum to 1 (Qwen3-MoE and DeepSeek-V3 do)."""
    score_func: Literal["softmax", "sigmoid", "topk_softmax"] = "softmax"
    """Routing scores: a softmax over the experts' logits (Qwen3-MoE, DeepSeek-V2), each logit's sigmoid
    (DeepSeek-V3), or a softmax over each token's top_k logits alone (GPT-OSS: the weights sum to 1, norm_topk_prob
    aside; the load-balancing loss reads the softmax over all logits)."""
    n_group: int = 1
    """Experts form this many groups of consecutive ids; a token picks its experts from its topk_group best groups,
    each group scored by the sum of its two best scores (DeepSeek-V3's node-limited routing). 1: no groups."""
    topk_group: int = 1
    """Groups a token may pick experts from (n_group > 1)."""
    routed_scaling_factor: float = 1.0
    """The routed experts' weights are multiplied by this (DeepSeek-V3: 2.5)."""
    num_shared_experts: int = 0
    """Experts every token passes through, unweighted, as one SwiGLU of num_shared_experts x hidden_dim units."""
    expert_bias: bool = False
    """Keep a routing bias even without balancing: DeepSeek-V3's checkpoints carry one (e_score_correction_bias).
    load_balance_coeff > 0 keeps one too."""
    router_bias: bool = False
    """A learned bias on the router's logits (GPT-OSS), a parameter the optimizer trains, unlike expert_bias."""
    expert_linear_bias: bool = False
    """Biases on the experts' matmuls (GroupedExperts' w1_bias, w2_bias, w3_bias: GPT-OSS)."""
    expert_function: ExpertFunction = swiglu_expert
    """An expert's math (ExpertFunction): SwiGLU, or a family's own (GPT-OSS's clamped SwiGLU)."""
    aux_loss_weight: float = 0.0
    """Weight of each MoE layer's load-balancing loss in the gradient, per forward pass of the step (so the
    weights of a step's micro-batches add up to the configured weight); 0: no such loss."""
    load_balance_coeff: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): each step moves every expert's routing bias by this much
    towards balance; 0: no bias."""


class Router(nn.Module):
    """Token-choice top-k routing over the experts' scores, a softmax over their logits or each one's sigmoid; each
    token goes to its top_k experts, weighted by their scores (renormalised over the k when norm_topk_prob) times
    routed_scaling_factor. The choice, not the weights, reads the scores plus a per-expert bias where there is one
    (DeepSeek-V3, arXiv:2408.15664), and with n_group > 1 only the experts of the token's topk_group best groups.
    With topk_softmax (GPT-OSS) the choice reads the logits themselves, as transformers' GptOssTopKRouter does (the
    same order as their softmax's, without its rounding ties), and the weights are the softmax of the top_k logits."""

    def __init__(self, dim: int, moe: MoEArgs) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.score_func = moe.score_func
        self.n_group = moe.n_group
        self.topk_group = moe.topk_group
        self.routed_scaling_factor = moe.routed_scaling_factor
        self.gate = nn.Linear(dim, moe.num_experts, bias=moe.router_bias)
        # A checkpointed state, but no parameter: the balancer, not the optimizer, moves it.
        has_bias = moe.expert_bias or moe.load_balance_coeff > 0
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts) if has_bias else None)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (tokens, dim) -> (weights (tokens, top_k) fp32, experts (tokens, top_k) int64, probs (tokens,
        num_experts) fp32: the scores as a distribution over the experts, for the load-balancing loss)."""
        logits = self.gate(x).float()
        scores = logits.sigmoid() if self.score_func == "sigmoid" else F.softmax(logits, dim=-1)
        choice = logits if self.score_func == "topk_softmax" else scores
        if self.expert_bias is not None:
            choice = choice + self.expert_bias
        if self.n_group > 1:
            choice = limit_to_groups(choice, self.n_group, self.topk_group)
        experts = choice.topk(self.top_k, dim=-1).indices
        if self.score_func == "topk_softmax":
            weights = F.softmax(logits.gather(-1, experts), dim=-1)
        else:
            weights = scores.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        probs = scores if self.score_func != "sigmoid" else scores / scores.sum(dim=-1, keepdim=True)
        return weights, experts, probs


def limit_to_groups(choice: Tensor, n_group: int, topk_group: int) -> Tensor:
    """`choice` (tokens, num_experts) with every expert outside the token's topk_group best groups set to -inf. The
    experts form n_group groups of consecutive ids, each scored by the sum of its two best choice values; ties go to
    the lower group, as torch.topk orders them."""
    tokens, num_experts = choice.shape
    grouped = choice.view(tokens, n_group, num_experts // n_group)  # (tokens, n_group, experts per group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (tokens, n_group)
    best_groups = group_scores.topk(topk_group, dim=-1).indices  # (tokens, topk_group)
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)  # (tokens, n_group)
    return grouped.masked_fill(~allowed[:, :, None], float("-inf")).view(tokens, num_experts)


def load_balancing_loss(probs: Tensor, counts: Tensor) -> Tensor:
    """Switch Transformer's auxiliary loss as Qwen3-MoE computes it (transformers' load_balancing_loss_func) for one
    layer: num_experts x the sum over experts of (tokens routed to e / tokens) x (e's mean routing probability).
    probs (tokens, num_experts), counts (num_experts,) routed tokens. top_k when every expert gets the same share."""
    num_tokens, num_experts = probs.shape
    return num_experts * (counts.float() / num_tokens * probs.mean(dim=0)).sum()


class AddAuxiliaryLoss(torch.autograd.Function):
    """Returns x unchanged and gives `loss` a gradient of 1 in the backward, as if it had been added to the training
    loss: the layer's balancing loss reaches its router wherever the layer runs (a pipeline stage without the
    output), and the reported loss stays the language-model loss (DeepSeek-V2's AddAuxiliaryLoss)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, loss: Tensor) -> Tensor:
        ctx.loss_dtype = loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=grad.device)


class MoE(nn.Module):
    """The sparse feed-forward: route, sort the tokens by expert, run the experts, and add each token's expert
    outputs back weighted by the router, and the shared experts' output where there are some. Keeps
    `tokens_per_expert`, the routed tokens each expert got in the training forwards since the balancer last read it
    (each routed copy once, also where activation checkpointing recomputes the block), for the metrics and the
    bias."""

    def __init__(self, dim: int, moe: MoEArgs) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.aux_loss_weight = moe.aux_loss_weight
        self.router = Router(dim, moe)
        self.experts = GroupedExperts(moe.num_experts, dim, moe.hidden_dim, moe.expert_linear_bias, moe.expert_function)
        self.shared_experts = (FeedForward(dim, moe.hidden_dim * moe.num_shared_experts)
                               if moe.num_shared_experts > 0 else None)
        self.register_buffer("tokens_per_expert", torch.zeros(moe.num_experts), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        bs, seq, dim = x.shape
        tokens = x.reshape(-1, dim)  # (bs * seq, dim)
        weights, experts, probs = self.router(tokens)
        flat_experts = experts.flatten()  # (bs * seq * top_k,): token t's choices at t * top_k ...
        ones = torch.ones_like(flat_experts, dtype=probs.dtype)
        counts = torch.zeros_like(probs[0]).scatter_add_(0, flat_experts, ones)  # (num_experts,) routed copies
        # Forwards without gradients are no training tokens (a pipeline stage's shape inference runs one), and a
        # recompute routes the same tokens again.
        if self.training and torch.is_grad_enabled() and not recomputing():
            self.tokens_per_expert.add_(counts.detach())
        order = flat_experts.argsort(stable=True)  # the routed copies grouped by expert
        source = order // self.top_k  # (bs * seq * top_k,): the token each sorted copy came from
        routed = self.experts(tokens[source], counts.long())  # (bs * seq * top_k, dim)
        weighted = routed * weights.flatten()[order, None].to(routed.dtype)
        out = torch.zeros_like(tokens).index_add_(0, source, weighted.to(tokens.dtype))  # (bs * seq, dim)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        if self.training and self.aux_loss_weight > 0:
            out = AddAuxiliaryLoss.apply(out, self.aux_loss_weight * load_balancing_loss(probs, counts))
        return out.view(bs, seq, dim)


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass: activation checkpointing's recompute of a block, eager, which
    would count the block's routed tokens a second time. A compiled block's recompute is part of its backward graph,
    which never replays the forward's buffer updates (and dynamo cannot trace the check)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """The mixture-of-experts layers of a model (or of a pipeline stage), by FQN."""
    return {name: module for name, module in model.named_modules() if isinstance(module, MoE)}
