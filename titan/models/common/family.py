"""What a model family is to the family-independent stages: one spec (ModelFamily) with its flavors, how to build
its args and model, its weight init and FLOP count, its parallel plan and its Hugging Face mapping. Each family's
folder defines its spec (family.py); titan/models/families.py registers them."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
from torch import nn

from titan.models.common.args import AttnBackend, DecoderArgs
from titan.models.common.flops import num_params
from titan.models.common.hf_mapping import HFMapping
from titan.models.common.parallel_plan import ParallelPlan


@dataclass(frozen=True)
class BuildOptions:
    """What a job sets on top of a flavor's shape: the tokenizer's vocabulary, the rotary table's length, the
    attention kernel, the loss's chunking, for mixtures of experts how they are kept balanced, and for multi-token
    prediction its loss's weight."""

    vocab_size: int
    vocab_size_multiple_of: int
    max_seq_len: int
    attn_backend: AttnBackend = "sdpa"
    loss_chunk_size: int = 1024
    moe_aux_loss_weight: float = 0.0
    """Load-balancing loss weight per forward pass (the job's weight over the forward passes of a step)."""
    moe_load_balance_coeff: float = 0.0
    mtp_loss_weight: float = 0.0
    """Weight of the multi-token prediction loss, for flavors with MTP modules (DecoderArgs.mtp_loss_weight)."""


ArgsT = TypeVar("ArgsT", bound=DecoderArgs)


def args_with_options(args: ArgsT, options: BuildOptions) -> ArgsT:
    """A flavor's `args` with what the job sets: the vocabulary, the rotary table's length, the attention kernel and
    the loss's chunking in every family; on a mixture of experts (args.moe, in the families and flavors that have
    one) the balancing options; the multi-token prediction loss's weight where the flavor has MTP
    modules (elsewhere the flavor's, 0)."""
    fields: dict[str, Any] = {
        "vocab_size": options.vocab_size, "vocab_size_multiple_of": options.vocab_size_multiple_of,
        "max_seq_len": options.max_seq_len, "attn_backend": options.attn_backend,
        "loss_chunk_size": options.loss_chunk_size}
    moe = getattr(args, "moe", None)
    if moe is not None:
        fields["moe"] = replace(moe, aux_loss_weight=options.moe_aux_loss_weight,
                                load_balance_coeff=options.moe_load_balance_coeff)
    if args.mtp_depth > 0:
        fields["mtp_loss_weight"] = options.mtp_loss_weight
    return replace(args, **fields)


@dataclass(frozen=True)
class ModelFamily:
    """One family: flavors by name, the functions the pipeline calls on its args and models, and how the parallel
    and checkpoint stages see its modules."""

    name: str
    """--model.name."""
    args_type: type[DecoderArgs]
    """The class of its args (every flavor's)."""
    flavors: Mapping[str, Any]
    model: Callable[[Any], nn.Module]
    """Builds the whole model from args (on the current default device: meta in the trainer)."""
    init_weights: Callable[[nn.Module, torch.device | str | None], None]
    """Fills a materialised model, or a pipeline stage of one, and rebuilds its rotary table."""
    flops_per_token: Callable[[Any, nn.Module, int], int]
    """Training FLOPs per token of a whole model (meta is fine) at a sequence length."""
    tensor_parallel_sizes: Callable[[Any], list[tuple[str, int]]]
    """The sizes tensor parallel splits, each with what it is: the degree must divide every one."""
    num_active_params: Callable[[Any, nn.Module], int]
    """Parameters one token's forward uses (all of them for a dense model), at full size."""
    parallel_plan: ParallelPlan
    """How the parallel stages split its modules (titan/models/common/parallel_plan.py)."""
    hf_mapping: Callable[[Any], HFMapping]
    """The transformers class that holds a model of these args."""

    def build_args(self, flavor: str, options: BuildOptions) -> Any:
        """The flavor's args with the job's options (args_with_options)."""
        return args_with_options(self.flavors[flavor], options)

    def describe(self, flavor: str, args: Any, model: nn.Module) -> str:
        """One line for the log: the family, flavor, sizes and parameter counts."""
        total = num_params(model, exclude_embedding=False)
        text = (f"Model {self.name} {flavor}: {total:,} parameters, dim {args.dim}, {args.n_layers} layers, "
                f"{args.n_heads} heads ({args.n_kv_heads} kv), vocab {args.vocab_size} (padded to "
                f"{model.tok_embeddings.num_embeddings})")
        moe = getattr(args, "moe", None)
        if moe is not None:
            text += (f"; {moe.num_experts} experts, top {moe.top_k}: {self.num_active_params(args, model):,} "
                     f"active per token")
        return text
