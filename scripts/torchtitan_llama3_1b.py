"""Titan's 1B job as a torchtitan 0.3.0 config, for scripts/gpu_check.py's side-by-side tokens/s on one card.

torchtitan 0.3.0 takes a job as `--module M --config F`: it imports M and calls F() for a Trainer.Config, then
applies the other flags to it. Its own "1B" flavor is not Titan's (it ties the output to the embedding and has
Llama 3's 128k vocabulary), so this module builds the model config from Titan's flavor table. Run it as a script,
which adds `--module torchtitan_llama3_1b --config titan_llama3_1b` to torchtitan's training entry point:

    python3 scripts/torchtitan_llama3_1b.py --hf_assets_path DIR --dataloader.dataset_path DIR \
        --parallelism.spmd_backend partial_dtensor --training.steps 20

--hf_assets_path is a folder holding Titan's shipped tokenizer as tokenizer.json (titan.data.hf_tokenizer writes
it) and --dataloader.dataset_path a folder holding a .jsonl of documents (the shipped corpus): both exist offline.

The job is gpu_check.py's TITAN_1B_JOB with --parallelism.force_fsdp --training.loss_chunk_size 0:
- Titan's 1B shape: dim 2048, 16 layers, 32 heads, 8 kv heads, SwiGLU hidden 8192, RoPE theta 500000 with Llama
  3.2's scaling, an untied output, the shipped tokenizer's 2256 ids padded to 2304 rows;
- 2 x 8192 tokens per step, bf16 by FSDP's mixed precision over a one-rank mesh (torchtitan wraps one GPU so
  anyway), selective per-op activation checkpointing, block-causal FlexAttention, eager with the attention kernel
  compiled on its own (untuned in both), the loss over the whole batch's logits;
- fused AdamW (lr 8e-4, betas 0.9 and 0.95, weight decay 0.1) on both frameworks' default schedule (200 warmup
  steps, then linear decay to 0), gradients clipped at 1.0.
Run as a script, it also adapts torchtitan 0.3.0, which follows torch's nightly builds, to the lent machines'
torch 2.11: provide_data_parallel_mesh_dims, pass_separate_full_blocks_by_default and provide_set_timeout.
gpu_check.py's TORCHTITAN_NOT_MATCHED lists what still differs between the two runs.
"""

import dataclasses
import inspect
import sys
from pathlib import Path

import torch
import torch.distributed.fsdp
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def provide_data_parallel_mesh_dims() -> None:
    """torchtitan 0.3.0 imports torch.distributed.fsdp.DataParallelMeshDims, which torch 2.12 added; the lent GPU
    machines have torch 2.11. Only torchtitan's full_dtensor and spmd_types backends build one (to pass fully_shard
    an argument torch 2.11 lacks too), so with --parallelism.spmd_backend partial_dtensor a stand-in with the same
    fields only has to exist for the imports."""
    if hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
        return

    @dataclasses.dataclass
    class DataParallelMeshDims:
        shard: str | tuple[str, ...] | None = None
        replicate: str | tuple[str, ...] | None = None

    torch.distributed.fsdp.DataParallelMeshDims = DataParallelMeshDims


provide_data_parallel_mesh_dims()  # before torchtitan's imports, which need it

from torchtitan import train  # noqa: E402
from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.components.optimizer import default_adamw  # noqa: E402
from torchtitan.config import CompileConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed.activation_checkpoint import SelectiveAC  # noqa: E402
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader  # noqa: E402
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, attention, decoder  # noqa: E402
from torchtitan.models.common.config_utils import decoder_vocab_size  # noqa: E402
from torchtitan.models.llama3 import (  # noqa: E402
    _EMBEDDING_INIT,
    _NORM_INIT,
    _build_llama3_layers,
    _output_linear_init,
    model_registry,
)
from torchtitan.models.llama3.model import Llama3Model  # noqa: E402
from torchtitan.protocols.model_spec import ModelSpec  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from titan.data.tokenizer import SHIPPED_TOKENIZER, build_tokenizer  # noqa: E402
from titan.models.common.args import padded_vocab_size  # noqa: E402
from titan.models.llama.args import LLAMA3_FLAVORS, ModelArgs, ffn_hidden_dim  # noqa: E402

LOCAL_BATCH_SIZE = 2
SEQ_LEN = 8192


def titan_model_config(args: ModelArgs, vocab_size: int) -> Llama3Model.Config:
    """torchtitan's Llama 3 model config with the shape of Titan's `args`: an untied output, `vocab_size` rows
    (Titan's padded vocabulary) and Titan's RoPE scaling."""
    scaling = args.rope_scaling
    assert scaling is not None, "Titan's 1B flavor has Llama 3.2's RoPE scaling"
    rope = ComplexRoPE.Config(dim=args.head_dim, max_seq_len=args.max_seq_len, theta=args.rope_theta, scaling="llama",
                              scaling_factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
                              high_freq_factor=scaling.high_freq_factor,
                              original_max_position_embeddings=scaling.original_max_position_embeddings)
    layers = _build_llama3_layers(n_layers=args.n_layers, dim=args.dim, n_heads=args.n_heads,
                                  n_kv_heads=args.n_kv_heads, hidden_dim=ffn_hidden_dim(args), rope=rope,
                                  fuse_qkv=True, attn_backend="flex")
    return Llama3Model.Config(
        dim=args.dim, vocab_size=vocab_size, enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=args.dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=args.dim, eps=args.norm_eps, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=args.dim, out_features=vocab_size, param_init=_output_linear_init(args.dim)),
        layers=layers)


def titan_1b_spec() -> ModelSpec:
    """torchtitan's llama3 model spec (its parallelize and pipeline functions) with Titan's 1B model over the
    shipped tokenizer."""
    vocab_size = padded_vocab_size(build_tokenizer(str(ROOT / SHIPPED_TOKENIZER)).vocab_size, multiple_of=64)
    return dataclasses.replace(model_registry("1B"), flavor="titan_1B",
                               model=titan_model_config(LLAMA3_FLAVORS["1B"], vocab_size))


def titan_llama3_1b() -> Trainer.Config:
    """The 1B job of gpu_check.py (module docstring); the data and tokenizer folders and the steps come as flags."""
    model_spec = titan_1b_spec()
    return Trainer.Config(
        model_spec=model_spec,
        # The whole batch's logits at once (Titan: --training.loss_chunk_size 0). torchtitan 0.3.0's chunked loss
        # (ChunkedLossWrapper) failed in backward under torch 2.11's FSDP, which torchtitan applies on one GPU too,
        # on the CPU: the final norm's gathered weight was freed before its backward ("data is not allocated yet").
        # torch 2.13 ran it.
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec)),
        optimizer=default_adamw(lr=8e-4),
        training=TrainingConfig(local_batch_size=LOCAL_BATCH_SIZE, seq_len=SEQ_LEN, max_norm=1.0, steps=20,
                                mixed_precision_param="bfloat16", disable_cuda_graphs=True),
        # "c4_test" reads the folder --dataloader.dataset_path names with load_dataset(folder): .jsonl, "text" field.
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test"),
        metrics=MetricsProcessor.Config(log_freq=5, disable_color_printing=True),
        activation_checkpoint=SelectiveAC.Config(),
        compile=CompileConfig(enable=False),
    )


def pass_separate_full_blocks_by_default() -> None:
    """torchtitan 0.3.0 builds its block masks with create_block_mask(..., separate_full_blocks=True), an argument
    torch 2.12 added; True is what torch 2.11 always does (the kernel visits a mask's full blocks apart from its
    partial ones), so on torch 2.11 the argument is dropped."""
    if "separate_full_blocks" in inspect.signature(create_block_mask).parameters:
        return

    def create_attention_mask(*args: object, separate_full_blocks: bool, **kwargs: object) -> BlockMask:
        if not separate_full_blocks:
            raise NotImplementedError("torchtitan's batch-invariant mode needs torch 2.12's separate_full_blocks")
        return attention.create_attention_mask(*args, **kwargs)

    decoder.create_attention_mask = create_attention_mask


def provide_set_timeout() -> None:
    """torchtitan 0.3.0 shortens its process groups' timeouts after the first step with torch.distributed.set_timeout,
    which torch 2.11 to 2.13 have only as the private distributed_c10d._set_pg_timeout, with the same arguments."""
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout


def compile_flex_attention_untuned() -> None:
    """Compile torchtitan's FlexAttention kernel without its max_autotune and coordinate-descent tuning, as Titan
    compiles its own: the same kernels, and no minutes of autotuning in a GPU check of a few minutes."""
    options = {name: value for name, value in attention.FlexAttention.inductor_configs.items()
               if name not in ("max_autotune", "coordinate_descent_tuning")}
    attention.FlexAttention._compiled_flex_attn = torch.compile(flex_attention, options=options)


def torchtitan_argv(flags: list[str]) -> list[str]:
    """torchtitan's command-line arguments for this module's job with `flags` on top."""
    return ["--module", Path(__file__).stem, "--config", titan_llama3_1b.__name__, *flags]


if __name__ == "__main__":
    pass_separate_full_blocks_by_default()
    provide_set_timeout()
    compile_flex_attention_untuned()
    sys.argv[1:] = torchtitan_argv(sys.argv[1:])
    train.main()
