"""The model families Titan trains, each as what the family-independent stages need from it: its flavors, how to
build its args and model, its weight init and its FLOP count. `--model.name` picks one; nothing else in the
pipeline asks which family it runs."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titan.models import llama, qwen3
from titan.models.common.args import AttnBackend
from titan.models.common.flops import num_params
from titan.models.llama.args import build_model_args


@dataclass(frozen=True)
class BuildOptions:
    """What a job sets on top of a flavor's shape: the tokenizer's vocabulary, the rotary table's length, the
    attention kernel, the loss's chunking, and for mixtures of experts how they are kept balanced."""

    vocab_size: int
    vocab_size_multiple_of: int
    max_seq_len: int
    attn_backend: AttnBackend = "sdpa"
    loss_chunk_size: int = 1024
    moe_aux_loss_weight: float = 0.0
    """Load-balancing loss weight per forward pass (the job's weight over the forward passes of a step)."""
    moe_load_balance_coeff: float = 0.0


@dataclass(frozen=True)
class ModelFamily:
    """One family: flavors by name, and the functions the pipeline calls on its args and models."""

    name: str
    flavors: Mapping[str, Any]
    build_args: Callable[[str, BuildOptions], Any]
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
    placeholder_eos_id: int
    """A token id of the flavors' placeholder vocabulary that ends documents, where the tokenizer file is absent (a
    dry run on another machine: only fake token ids carry it)."""

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


def build_llama3_args(flavor: str, options: BuildOptions) -> llama.ModelArgs:
    return build_model_args(flavor, options.vocab_size, options.vocab_size_multiple_of, options.max_seq_len,
                            options.attn_backend, options.loss_chunk_size)


def llama3_flops(args: llama.ModelArgs, model: nn.Module, seq_len: int) -> int:
    return llama.flops_per_token(args, num_params(model, exclude_embedding=True), seq_len)


def llama3_active_params(args: llama.ModelArgs, model: nn.Module) -> int:
    return num_params(model, exclude_embedding=False)


def llama3_tensor_parallel_sizes(args: llama.ModelArgs) -> list[tuple[str, int]]:
    return [("attention heads", args.n_heads), ("kv heads", args.n_kv_heads),
            ("FFN hidden size", llama.ffn_hidden_dim(args))]


def qwen3_tensor_parallel_sizes(args: qwen3.Qwen3Args) -> list[tuple[str, int]]:
    return [("attention heads", args.n_heads), ("kv heads", args.n_kv_heads), ("FFN hidden size", args.hidden_dim)]


def qwen3_active_params(args: qwen3.Qwen3Args, model: nn.Module) -> int:
    return qwen3.num_active_params(model, args, exclude_embedding=False)


def build_qwen3_args(flavor: str, options: BuildOptions) -> qwen3.Qwen3Args:
    return qwen3.build_qwen3_args(flavor, options.vocab_size, options.vocab_size_multiple_of, options.max_seq_len,
                                  options.attn_backend, options.loss_chunk_size, options.moe_aux_loss_weight,
                                  options.moe_load_balance_coeff)


def qwen3_flops(args: qwen3.Qwen3Args, model: nn.Module, seq_len: int) -> int:
    """Active parameters only: an MoE token's FLOPs come from its top_k experts (the dry run and MFU agree)."""
    return qwen3.flops_per_token(args, qwen3.num_active_params(model, args, exclude_embedding=True), seq_len)


FAMILIES: dict[str, ModelFamily] = {
    "llama3": ModelFamily(name="llama3", flavors=llama.LLAMA3_FLAVORS, build_args=build_llama3_args,
                          model=llama.Transformer, init_weights=llama.init_weights, flops_per_token=llama3_flops,
                          tensor_parallel_sizes=llama3_tensor_parallel_sizes,
                          num_active_params=llama3_active_params, placeholder_eos_id=llama.LLAMA3_BOS_ID),
    "qwen3": ModelFamily(name="qwen3", flavors=qwen3.QWEN3_FLAVORS, build_args=build_qwen3_args,
                         model=qwen3.Transformer, init_weights=qwen3.init_weights, flops_per_token=qwen3_flops,
                         tensor_parallel_sizes=qwen3_tensor_parallel_sizes, num_active_params=qwen3_active_params,
                         placeholder_eos_id=qwen3.QWEN3_EOS_ID),
}


def linear_fqns(family: str, flavor: str) -> list[str]:
    """FQNs of the linear layers of a flavor, from a build on the meta device (no memory, milliseconds even for the
    largest): what a converter's --*.filter_fqns entries are matched against."""
    with torch.device("meta"):
        model = FAMILIES[family].model(FAMILIES[family].flavors[flavor])
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
