"""Parallel layouts on real gloo processes match one process on the same global batch."""

import itertools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.device_mesh import init_device_mesh

from titan.config.errors import ConfigError
from titan.config.job import JobConfig
from titan.config.load import load_toml, parse_args
from titan.data.dataset import SHIPPED_CORPUS, read_jsonl_documents
from titan.dry_run import documented_world_size
from titan.models.common.loss import cross_entropy_loss
from titan.models.families import FAMILIES
from titan.models.llama import ModelArgs, Transformer
from titan.models.qwen3 import QWEN3_FLAVORS
from titan.models.qwen3 import Transformer as Qwen3
from titan.models.qwen3 import init_weights as init_qwen3
from titan.parallel.ac import apply_ac, keeps_attention, records_ops
from titan.parallel.compile import apply_compile
from titan.parallel.dims import resolve_dims
from titan.parallel.ep import block_experts
from titan.parallel.fsdp import apply_expert_fsdp, apply_fsdp
from titan.parallel.parallelize import parallelize_model
from titan.train.trainer import Trainer
from titan.train.watchdog import COLLECTIVE_TIMEOUT_MARGIN
from titan.validate import load_job_config

from harness.debug_training import NUM_LAYERS
from harness.models import build_model
from harness.parallel_harness import PROBE_CASE
from harness.torchrun import CaseResults, run_cases

ROOT = Path(__file__).resolve().parents[1]
DEBUG_TOML = str(ROOT / "configs" / "debug_model.toml")
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))
STEPS = 2
# fp32 everywhere so layouts can agree to 1e-5; an lr high enough that 2 steps move the weights visibly (the second
# update reads the Adam moments of the first, so the optimizer state's layout counts too). Each run ends with an
# evaluation of 2 held-out batches under its layout.
BASE = ["--job.config_file", DEBUG_TOML, "--training.steps", str(STEPS), "--training.seq_len", "64",
        "--training.mixed_precision_param", "float32", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "1",
        "--validation.enable", "--validation.steps", "2"]


PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
CAUSAL = ["--model.attn_mask_type", "causal"]
CHUNKS = ["--training.loss_chunk_size", "48"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
# The output layer converts too (it is TP-sharded). Emulated: the same quantization with fp32 matmuls, since CPU
# float8 matmuls are slow and CPUs have no MX matmul; native _scaled_mm is covered by tests/test_float8.py.
FLOAT8 = ["--model.converters", "float8", "--float8.emulate", "--float8.filter_fqns"]
MX = ["--model.converters", "mx", "--mx.emulate", "--mx.filter_fqns"]
# NVFP4, emulated: under TP each rank quantizes its shards with their own tensor scales (torchao's NVFP4 TP rule).
NVFP4 = ["--model.converters", "nvfp4", "--nvfp4.emulate"]
# Blockwise float8 (DeepSeek-V3's 1 x 128 and 128 x 128 scales), emulated. wk and wv (128 rows) stay in high
# precision in every layout: TP 2 could not split them into whole 128-row blocks, and the reference must convert what
# the layouts convert.
BLOCKWISE = ["--model.converters", "float8", "--float8.emulate", "--float8.recipe_name", "blockwise",
             "--float8.filter_fqns", "wk", "wv"]
AOT_EAGER = ["--compile.backend", "aot_eager"]
ACCUMULATE = ["--training.local_batch_size", "4", "--training.global_batch_size", "8"]
BF16_STATE = ["--optimizer.state_dtype", "bfloat16"]
QWEN3 = ["--model.name", "qwen3"]
QWEN3_TIED = [*QWEN3, "--model.flavor", "debugmodel_tied"]
# The routing bias at its default. No load-balancing loss: it is a function of each micro-batch's tokens, so data
# parallel ranks' losses differ from one process's (tests/test_moe.py checks its value and gradient).
QWEN3_MOE = [*QWEN3, "--model.flavor", "debugmodel_moe"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
# Fine-tuning on the shipped conversations, packed whole, most targets masked (docs/sft.md); evaluated on them too.
CHATS = str(SHIPPED_CORPUS.parent / "stdlib_chats.jsonl.gz")
SFT = ["--training.dataset", "chat", "--training.dataset_path", CHATS, "--validation.dataset", "chat",
       "--validation.dataset_path", CHATS]
DEEPSEEK_V3 = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
DEEPSEEK_V3_MTP = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel_mtp"]
# The experts in low precision, emulated, both converters in one model: float8 rowwise for the first MoE layers'
# experts, MXFP8 for the others', with scales that do not depend on how the tokens are split over ranks (per token
# row, per expert row, per column of each expert's tokens, which expert parallel gathers whole). Not float8
# tensorwise, which scales the tokens by the amax of each rank's own; the dense linears stay in high precision, since
# their FSDP shares of the batch change their activation and weight-gradient scales (the float8 cases below).
QWEN3_MOE_LOW_PRECISION = [
    *QWEN3_MOE, "--model.converters", "float8", "mx", "--float8.emulate", "--float8.recipe_name", "rowwise",
    "--float8.filter_fqns", "output", "attention", "--float8.moe_fqns_prototype", "layers.0.", "layers.1.", "layers.2.",
    "--mx.emulate", "--mx.filter_fqns", "output", "attention", "--mx.moe_fqns_prototype", "layers.3.", "layers.4.",
    "layers.5."]
# The experts in blockwise float8 (emulated grouped matmuls: tiles per token row, 128-row tiles down each expert's
# padded tokens and 128 x 128 blocks per expert, none of which depends on the ranks' split of the batch).
QWEN3_MOE_BLOCKWISE = [*QWEN3_MOE, "--model.converters", "float8", "--float8.emulate", "--float8.recipe_name",
                       "blockwise", "--float8.filter_fqns", "output", "attention"]
DEEPSEEK_V3_LOW_PRECISION = [  # block 0 is dense; blocks 1 and 2 have experts
    *DEEPSEEK_V3, "--model.converters", "float8", "mx", "--float8.emulate", "--float8.recipe_name", "rowwise",
    "--float8.filter_fqns", "output", "attention", "feed_forward", "shared_experts", "--float8.moe_fqns_prototype",
    "layers.1.", "--mx.emulate", "--mx.filter_fqns", "output", "attention", "feed_forward", "shared_experts",
    "--mx.moe_fqns_prototype", "layers.2."]
# GPT-OSS: alternating sliding-window (16 of the 64 tokens) and full attention with sinks and biases, a biased router
# and biased experts (titan/models/gpt_oss). The experts in low precision as the MoE cases above, and the attention's
# linears in float8 with the weight gradient in high precision (rowwise_with_gw_hp: every scale is per token or per
# weight row, so no rank's share of the batch changes one).
GPT_OSS = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel"]
GPT_OSS_LOW_PRECISION = [
    *GPT_OSS, "--model.converters", "float8", "mx", "--float8.emulate", "--float8.recipe_name", "rowwise_with_gw_hp",
    "--float8.filter_fqns", "output", "--float8.moe_fqns_prototype", "layers.0.", "layers.1.", "--mx.emulate",
    "--mx.filter_fqns", "output", "attention", "--mx.moe_fqns_prototype", "layers.2.", "layers.3."]
# Muon (titan/train/muon.py): each sharded matrix gathered whole on one rank of its shard group, orthogonalised
# there and scattered back; the experts' stacks orthogonalised where they lie.
MUON = ["--optimizer.name", "Muon"]
PIPELINE_SCHEDULES = {
    "GPipe": ["--parallelism.pipeline_parallel_split_points", "layers.2"],  # uneven: blocks 0-1 | 2-5
    "1F1B": [],
    # 4 stages of 1, 2, 2, 1 blocks; rank 0 runs stages 0 and 2. The last stage's loss in chunks of a micro-batch.
    "Interleaved1F1B": ["--training.loss_chunk_size", "48"],
    "InterleavedZeroBubble": [],
    # A V: rank 0 runs stages 0 and 3, so it computes the loss. torch's V schedule has no forward-only pass
    # (titan/train/rules.py), so ZBV trains without evaluating.
    "ZBVZeroBubble": ["--validation.no_enable"],
}


@dataclass(frozen=True)
class Layout:
    nprocs: int
    flags: list[str]
    reference: str | None = "ref"
    """The one-process run it must match (None: it is one)."""


def layouts(nprocs: int, reference: str | None = "ref", **cases: list[str]) -> dict[str, Layout]:
    return {name: Layout(nprocs, flags, reference) for name, flags in cases.items()}



# Every run of the parity tests by name. A test asks for one by its `case` parameter; the `runs` fixture starts the
# cases that the selected tests ask for, and their references, in one launch per world size (run_cases).
LAYOUTS = {
    # The global batch of 4 sequences. The data order is global, so it is also the global batch of 2 data-parallel
    # ranks of 2 sequences each (and each layout's local batch x data-parallel degree).
    **layouts(1, None, ref=["--training.local_batch_size", "4"], ref_accumulate=ACCUMULATE,
              ref_float8=["--training.local_batch_size", "4", *FLOAT8],
              ref_mx=["--training.local_batch_size", "4", *MX],
              ref_blockwise=["--training.local_batch_size", "4", *BLOCKWISE],
              ref_nvfp4=["--training.local_batch_size", "4", *NVFP4]),
    # FSDP2 over a one-rank mesh in one process (--parallelism.force_fsdp), and CPU offload, which forces it there:
    # the sharded (DTensor) code of multi-GPU runs, as one GPU runs it.
    **layouts(1, fsdp1=["--training.local_batch_size", "4", "--parallelism.force_fsdp"],
              fsdp1_cpu_offload=["--training.local_batch_size", "4", "--training.enable_cpu_offload"]),
    # CHUNKS: the output layer and loss in chunks of 48 of a rank's 128 tokens (FSDP's 2 sequences, TP's half of 4).
    **layouts(2, fsdp2=["--training.local_batch_size", "2", *FSDP2, *CHUNKS],
              # shards, gradients and Adam state in host memory, the update on the host (CPUOffloadPolicy)
              fsdp2_cpu_offload=["--training.local_batch_size", "2", *FSDP2, "--training.enable_cpu_offload"],
              tp2=["--training.local_batch_size", "4", *TP2, *CHUNKS],
              tp2_gathered=["--training.local_batch_size", "4", *TP2, "--parallelism.disable_loss_parallel", *CHUNKS],
              tp2_compiled=["--training.local_batch_size", "4", *TP2, "--training.compile"],
              **{f"pp2_{schedule}": ["--training.local_batch_size", "4", *PP2,
                                     "--parallelism.pipeline_parallel_schedule", schedule, *flags]
                 for schedule, flags in PIPELINE_SCHEDULES.items()},
              cp2_allgather=["--training.local_batch_size", "4", *CP2,
                             "--parallelism.context_parallel_rotate_method", "allgather"],
              # Compile under PP and under CP with AC: what these layouts change is what dynamo and AOTAutograd
              # capture (pipeline stages' blocks, CP's attention, AC's recomputed regions), which aot_eager traces as
              # inductor does, in a fraction of its time; inductor's kernels under a layout are tp2_compiled's.
              pp2_compiled_full_ac=["--training.local_batch_size", "4", "--training.compile", *AOT_EAGER, *PP2,
                                    "--activation_checkpoint.mode", "full"],
              cp2_compiled_selective_ac=["--training.local_batch_size", "4", "--training.compile", *AOT_EAGER, *CP2,
                                         "--activation_checkpoint.mode", "selective"]),
    **layouts(2, "ref_accumulate",
              pp2_accumulate=[*ACCUMULATE, *PP2, "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    # Causal attention across documents (--model.attn_mask_type causal) under the layouts that carry it differently:
    # FSDP, the pipeline (positions by keyword to every stage), and context parallel's exchange without documents.
    **layouts(1, None, ref_causal=["--training.local_batch_size", "4", *CAUSAL]),
    **layouts(2, "ref_causal", fsdp2_causal=["--training.local_batch_size", "2", *FSDP2, *CAUSAL],
              pp2_causal=["--training.local_batch_size", "4", *PP2, *CAUSAL],
              cp2_causal=["--training.local_batch_size", "4", *CP2, *CAUSAL]),
    # Conversations: the loss over their assistant tokens, normalized per valid target, under every split of them,
    # with variants of the layouts that the documents' cases leave out: checkpointed TP blocks keeping their
    # attention and reduce-scatter outputs (save_attention) on DTensors, and CP's all-to-all exchange. (HSDP:
    # qwen3_moe_hsdp2_ep2.)
    **layouts(1, None, ref_sft=["--training.local_batch_size", "4", *SFT]),
    **layouts(2, "ref_sft", fsdp2_sft=["--training.local_batch_size", "2", *FSDP2, *SFT],
              tp2_full_ac_sft=["--training.local_batch_size", "4", *TP2, "--activation_checkpoint.mode", "full", *SFT],
              pp2_sft=["--training.local_batch_size", "4", *PP2, *SFT],
              cp2_alltoall_sft=["--training.local_batch_size", "4", *CP2,
                                "--parallelism.context_parallel_rotate_method", "alltoall", *SFT]),
    **layouts(2, "ref_float8", fsdp2_float8=["--training.local_batch_size", "2", *FSDP2, *FLOAT8],
              tp2_float8=["--training.local_batch_size", "4", *TP2, *FLOAT8],
              cp2_float8=["--training.local_batch_size", "4", *CP2, *FLOAT8]),
    **layouts(2, "ref_mx", fsdp2_mx=["--training.local_batch_size", "2", *FSDP2, *MX],
              tp2_mx=["--training.local_batch_size", "4", *TP2, *MX]),
    **layouts(2, "ref_blockwise", fsdp2_blockwise=["--training.local_batch_size", "2", *FSDP2, *BLOCKWISE],
              tp2_blockwise=["--training.local_batch_size", "4", *TP2, *BLOCKWISE],
              cp2_blockwise=["--training.local_batch_size", "4", *CP2, *BLOCKWISE]),
    **layouts(2, "ref_nvfp4", tp2_nvfp4=["--training.local_batch_size", "4", *TP2, *NVFP4]),
    # bfloat16 optimizer state: sharded moments, each FSDP rank rounding its own shard with its own random bits.
    **layouts(1, None, ref_bf16_state=["--training.local_batch_size", "4", *BF16_STATE]),
    # Under TP some gradients come back in another layout than their parameters (Partial norms, the output layer).
    **layouts(2, "ref_bf16_state", fsdp2_bf16_state=["--training.local_batch_size", "2", *FSDP2, *BF16_STATE],
              tp2_bf16_state=["--training.local_batch_size", "4", *TP2, *BF16_STATE]),
    # Qwen3: QK-norm and a head size of its own under TP and PP; the MoE flavor with expert parallel (EP borrows the
    # data-parallel ranks: EP=2 on 2 ranks also FSDP-shards the dense layers over them), its all-to-all, its aux loss
    # and its routing bias.
    **layouts(1, None, ref_qwen3=["--training.local_batch_size", "4", *QWEN3],
              ref_qwen3_tied=["--training.local_batch_size", "4", *QWEN3_TIED],
              ref_qwen3_moe=["--training.local_batch_size", "4", *QWEN3_MOE]),
    **layouts(2, "ref_qwen3_tied", qwen3_tied_tp2=["--training.local_batch_size", "4", *QWEN3_TIED, *TP2],
              qwen3_tied_fsdp2=["--training.local_batch_size", "2", *QWEN3_TIED, *FSDP2]),
    **layouts(2, "ref_qwen3", qwen3_tp2=["--training.local_batch_size", "4", *QWEN3, *TP2, *CHUNKS],
              qwen3_pp2=["--training.local_batch_size", "4", *QWEN3, *PP2]),
    # FSDP, PP, CP with EP of a mixture of experts: DeepSeek-V3's cases below; EP 2 and EP 2 x expert FSDP 2: the
    # low-precision experts' cases below (the same layouts, with the experts' other matmuls). HSDP: 2 replicas of
    # EP 2 (the experts' own HSDP mesh).
    **layouts(4, "ref_qwen3_moe", qwen3_moe_hsdp2_ep2=["--training.local_batch_size", "1", *QWEN3_MOE, *EP2,
                                   "--parallelism.data_parallel_replicate_degree", "2",
                                   "--parallelism.data_parallel_shard_degree", "2"]),
    # DeepSeek-V3: latent attention (values narrower than keys, through CP's ring), a dense first block before the
    # experts (on PP's first stage), shared experts; with multi-token prediction where it runs (not PP, not CP).
    **layouts(1, None, ref_deepseek_v3=["--training.local_batch_size", "4", *DEEPSEEK_V3],
              ref_deepseek_v3_mtp=["--training.local_batch_size", "4", *DEEPSEEK_V3_MTP]),
    # EP 2 borrows the context-parallel ranks, each holding half of every sequence's tokens. EP 2 alone against one
    # process: tests/test_checkpoint.py's resume on one process. Not compiled here: a mixture of experts' graph breaks
    # make even aot_eager cost 10 s a case (the closing note of issue 36 has the compiled runs).
    **layouts(2, "ref_deepseek_v3",
              deepseek_v3_cp2_ep2=["--training.local_batch_size", "4", *DEEPSEEK_V3, *CP2, *EP2]),
    # Mixtures of experts inside checkpointed blocks, the layouts of the shipped MoE configs: the token counts (a
    # buffer no state dict carries, which the ranks' init copies by name from a full copy) and the balancer's bias
    # updates from them. FSDP with selective AC by op; a pipeline of 3 stages of one block each, whose rank 0 holds
    # only DeepSeek-V3's dense block, checkpointing every second block (blocks 0 and 2: one record's MoE layers
    # counted with and without a recompute); and DeepSeek-V3 671B's layout on 4 ranks: full AC, PP 2, EP 2 (which
    # FSDP-shards the dense layers over its 2 ranks).
    **layouts(2, "ref_qwen3_moe",
              qwen3_moe_fsdp2_selective_ac=["--training.local_batch_size", "2", *QWEN3_MOE, *FSDP2,
                                            "--activation_checkpoint.mode", "selective"]),
    **layouts(3, "ref_deepseek_v3",
              deepseek_v3_pp3_selective_ac=["--training.local_batch_size", "4", *DEEPSEEK_V3,
                                            "--parallelism.pipeline_parallel_degree", "3",
                                            "--activation_checkpoint.mode", "selective",
                                            "--activation_checkpoint.selective_ac_option", "2"]),
    **layouts(4, "ref_deepseek_v3",
              deepseek_v3_pp2_ep2_full_ac=["--training.local_batch_size", "2", *DEEPSEEK_V3, *PP2, *EP2,
                                           "--parallelism.pipeline_parallel_microbatch_size", "1",
                                           "--activation_checkpoint.mode", "full"]),
    **layouts(2, "ref_deepseek_v3_mtp",
              deepseek_v3_mtp_fsdp2=["--training.local_batch_size", "2", *DEEPSEEK_V3_MTP, *FSDP2]),
    # The experts' low-precision grouped matmuls under EP 2 (which FSDP-shards the dense layers over its 2 ranks) and
    # EP 2 x expert FSDP 2 (dense FSDP over 4).
    **layouts(1, None, ref_qwen3_moe_low_precision=["--training.local_batch_size", "4", *QWEN3_MOE_LOW_PRECISION],
              ref_deepseek_v3_low_precision=["--training.local_batch_size", "4", *DEEPSEEK_V3_LOW_PRECISION],
              ref_qwen3_moe_blockwise=["--training.local_batch_size", "4", *QWEN3_MOE_BLOCKWISE]),
    **layouts(4, "ref_qwen3_moe_blockwise",
              qwen3_moe_blockwise_ep2_fsdp2=["--training.local_batch_size", "1", *QWEN3_MOE_BLOCKWISE, *EP2]),
    **layouts(2, "ref_qwen3_moe_low_precision",
              qwen3_moe_low_precision_ep2=["--training.local_batch_size", "2", *QWEN3_MOE_LOW_PRECISION, *EP2]),
    **layouts(4, "ref_qwen3_moe_low_precision",
              qwen3_moe_low_precision_ep2_fsdp2=["--training.local_batch_size", "1", *QWEN3_MOE_LOW_PRECISION, *EP2]),
    **layouts(2, "ref_deepseek_v3_low_precision",
              deepseek_v3_low_precision_ep2=["--training.local_batch_size", "2", *DEEPSEEK_V3_LOW_PRECISION, *EP2]),
    **layouts(4, "ref_deepseek_v3_low_precision",
              deepseek_v3_low_precision_ep2_fsdp2=["--training.local_batch_size", "1", *DEEPSEEK_V3_LOW_PRECISION,
                                                   *EP2]),
    # GPT-OSS: context parallel's ring through windows (some key chunks wholly before a query chunk's window) with
    # the sinks applied once after the ranks' softmaxes merge, under EP and selective AC; a pipeline of a sliding and
    # a full block per stage, fully checkpointed; FSDP with compiled blocks (aot_eager, as the PP and CP cases
    # above); and EP 2 x expert FSDP 2 with low-precision experts and attention.
    **layouts(1, None, ref_gpt_oss=["--training.local_batch_size", "4", *GPT_OSS],
              ref_gpt_oss_low_precision=["--training.local_batch_size", "4", *GPT_OSS_LOW_PRECISION]),
    **layouts(2, "ref_gpt_oss",
              gpt_oss_cp2_ep2_selective_ac=["--training.local_batch_size", "4", *GPT_OSS, *CP2, *EP2,
                                            "--parallelism.context_parallel_rotate_method", "alltoall",
                                            "--activation_checkpoint.mode", "selective"],
              gpt_oss_pp2_full_ac=["--training.local_batch_size", "4", *GPT_OSS, *PP2,
                                   "--activation_checkpoint.mode", "full"],
              gpt_oss_fsdp2_compiled=["--training.local_batch_size", "2", *GPT_OSS, *FSDP2, "--training.compile",
                                      *AOT_EAGER]),
    **layouts(4, "ref_gpt_oss_low_precision",
              gpt_oss_low_precision_ep2_fsdp2=["--training.local_batch_size", "1", *GPT_OSS_LOW_PRECISION, *EP2]),
    # Muon under each layout that shards its matrices: FSDP (rows), TP (columns or rows), both (a 4-rank group), HSDP
    # (each replica's shard group), the pipeline (each stage its own), and for the experts EP (whole stacks per rank)
    # and EP x expert FSDP; DeepSeek-V3's and GPT-OSS's own parts (MLA's fused wkv_a, MTP, sinks, biased experts and
    # router) under FSDP 2 x EP 2.
    **layouts(1, None, ref_muon=["--training.local_batch_size", "4", *MUON],
              ref_muon_moe=["--training.local_batch_size", "4", *QWEN3_MOE, *MUON],
              ref_muon_deepseek_v3=["--training.local_batch_size", "4", *DEEPSEEK_V3_MTP, *MUON],
              ref_muon_gpt_oss=["--training.local_batch_size", "4", *GPT_OSS, *MUON]),
    **layouts(2, "ref_muon_deepseek_v3",
              muon_deepseek_v3_ep2=["--training.local_batch_size", "2", *DEEPSEEK_V3_MTP, *EP2, *MUON]),
    **layouts(2, "ref_muon_gpt_oss", muon_gpt_oss_ep2=["--training.local_batch_size", "2", *GPT_OSS, *EP2, *MUON]),
    **layouts(2, "ref_muon", muon_fsdp2=["--training.local_batch_size", "2", *FSDP2, *MUON],
              muon_tp2=["--training.local_batch_size", "4", *TP2, *MUON],
              muon_pp2=["--training.local_batch_size", "4", *PP2, *MUON]),
    **layouts(2, "ref_muon_moe", muon_moe_ep2=["--training.local_batch_size", "2", *QWEN3_MOE, *EP2, *MUON],
              muon_moe_pp2=["--training.local_batch_size", "4", *QWEN3_MOE, *PP2, *MUON]),
    **layouts(4, "ref_muon", muon_fsdp2_tp2=["--training.local_batch_size", "2", *FSDP2, *TP2, *MUON]),
    **layouts(4, "ref_muon_moe",
              muon_moe_ep2_fsdp2=["--training.local_batch_size", "1", *QWEN3_MOE, *EP2, *MUON],
              muon_moe_hsdp2_ep2=["--training.local_batch_size", "1", *QWEN3_MOE, *EP2, *MUON,
                                  "--parallelism.data_parallel_replicate_degree", "2",
                                  "--parallelism.data_parallel_shard_degree", "2"]),
    **layouts(4, fsdp2_tp2=["--training.local_batch_size", "2", *FSDP2, *TP2],
              pp2_fsdp2=["--training.local_batch_size", "2", *PP2, *FSDP2],
              pp2_tp2=["--training.local_batch_size", "4", *PP2, *TP2],
              # FSDP shards over dp_shard x cp = 4 ranks; the loss averages over dp x cp. Fully checkpointed blocks
              # around CP's attention, as the 128k config runs them.
              cp2_fsdp2_full_ac=["--training.local_batch_size", "2", *CP2, *FSDP2, "--activation_checkpoint.mode",
                                 "full"]),
}


def write_short_documents(path: Path) -> Path:
    """A jsonl file of the shipped corpus cut into documents of 2 to 30 words (a few to about 70 tokens), so that
    nearly every window of 64 tokens packs several documents and block-causal attention (the default) shows in
    every layout: the shipped documents are longer than such a window."""
    words = " ".join(itertools.islice(read_jsonl_documents(SHIPPED_CORPUS, origin="test"), 20)).split()
    lengths = itertools.cycle([2, 30, 9, 17, 5])
    documents, start = [], 0
    while start < len(words):
        length = next(lengths)
        documents.append(" ".join(words[start:start + length]))
        start += length
    path.write_text("".join(json.dumps({"text": document}) + "\n" for document in documents))
    return path


@pytest.fixture(scope="module")
def launched(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CaseResults:
    """The result of every case the selected tests of this module ask for, and of their references, on data of
    short documents (training and validation); and of every probe (PROBES, named PROBE_PREFIX + its name) when a
    selected test reads one. One launch per world size runs both kinds (parallel_harness.py)."""
    selected = [item for item in request.session.items if item.module is request.module]
    asked = {item.callspec.params["case"] for item in selected
             if "case" in getattr(getattr(item, "callspec", None), "params", {})}
    names = asked | {LAYOUTS[name].reference for name in asked} - {None}
    documents = str(write_short_documents(tmp_path_factory.mktemp("data") / "short_documents.jsonl"))
    data = ["--training.dataset", "jsonl", "--training.dataset_path", documents, "--validation.dataset", "jsonl",
            "--validation.dataset_path", documents]
    folders = {nprocs: tmp_path_factory.mktemp(f"nprocs{nprocs}")
               for nprocs in {LAYOUTS[name].nprocs for name in names} | set(PROBES)}
    cases: dict[int, dict[str, list[str]]] = {}
    for name in sorted(names):
        folder = folders[LAYOUTS[name].nprocs]
        cases.setdefault(LAYOUTS[name].nprocs, {})[name] = [*BASE, *data, "--job.dump_folder", str(folder / name),
                                                            *LAYOUTS[name].flags]
    if any("probes" in item.fixturenames for item in selected):
        for nprocs, probes in PROBES.items():
            for name, flags in probes.items():
                cases.setdefault(nprocs, {})[PROBE_PREFIX + name] = [
                    PROBE_CASE, *PROBE, "--job.dump_folder", str(folders[nprocs] / (PROBE_PREFIX + name)), *flags]
    results = CaseResults({}, {})
    for nprocs, named in sorted(cases.items()):
        results.update(run_cases("parallel_harness.py", nprocs, folders[nprocs], named))
    return results


@pytest.fixture(scope="module")
def runs(launched: CaseResults) -> CaseResults:
    return launched


def assert_same_run(runs: CaseResults, case: str, evaluated: bool = True, weight_atol: float = 1e-4,
                    loss_falls: bool = True) -> None:
    """`case` ran like its one-process reference: losses, validation loss and final weights. `loss_falls`: the
    reference's second batch has a lower loss than its first, which a model that learns this fast shows; otherwise
    every step's gradient norm and learning rate were nonzero, so Adam moved the weights."""
    got, ref = runs[case], runs[LAYOUTS[case].reference]
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=0)
    if evaluated:
        assert got["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)
    assert got["weights"].keys() == ref["weights"].keys()
    # Adam divides by sqrt(v): where a gradient is near zero, reduction-order noise moves an update by up to
    # ~1e-5. Far below one step's size (lr 3e-3), so a wrong update would still fail.
    for name, value in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, rtol=1e-4, atol=weight_atol, msg=name)
    # Training really moved the weights, so equal final weights mean equal updates.
    if loss_falls:
        assert ref["losses"][-1] < ref["losses"][0]
    else:
        assert [record["step"] for record in ref["metrics"]] == [1, STEPS]
        assert all(record["grad_norm"] > 0 and record["lr"] > 0 for record in ref["metrics"])


@pytest.mark.parametrize("case", ["fsdp2", "fsdp2_cpu_offload", "fsdp1", "fsdp1_cpu_offload"])
def test_data_parallel_matches_one_process(runs: CaseResults, case: str) -> None:
    assert_same_run(runs, case)


@pytest.mark.parametrize("case", ["tp2"])
def test_tensor_parallel_matches_one_process(runs: CaseResults, case: str) -> None:
    assert_same_run(runs, case)


@pytest.mark.parametrize("case", ["tp2_gathered"])
def test_tensor_parallel_without_loss_parallel(runs: CaseResults, case: str) -> None:
    assert_same_run(runs, case)


@pytest.mark.parametrize("case", ["tp2_compiled"])
def test_compiled_tensor_parallel_matches_one_process(runs: CaseResults, case: str) -> None:
    """Compiled blocks under TP: the layout in which a plain-tensor residual stream broke gradients."""
    assert_same_run(runs, case)


@pytest.mark.parametrize("case", ["qwen3_tied_tp2", "qwen3_tied_fsdp2"])
def test_qwen3_tied_output_stays_the_embedding(runs: CaseResults, case: str) -> None:
    """The tie survives materialisation, TP's separate distribution of the two modules, and FSDP: one matrix, so
    its gradient is the sum of both uses and the layouts agree. The tied matrix's rows of tokens absent from the
    batches get gradients near zero, where Adam turns reduction-order noise into updates of up to 3e-4 (3 elements
    of 590k here); a lost gradient path would move whole rows by about lr (3e-3) per step."""
    assert_same_run(runs, case, weight_atol=1e-3)
    for run in (runs[case], runs[LAYOUTS[case].reference]):
        assert torch.equal(run["weights"]["output.weight"], run["weights"]["tok_embeddings.weight"])


@pytest.mark.parametrize("case", ["qwen3_tp2", "qwen3_pp2", "qwen3_moe_hsdp2_ep2"])
def test_qwen3_layouts_match_one_process(runs: CaseResults, case: str) -> None:
    assert_same_run(runs, case)


@pytest.mark.parametrize("case", ["deepseek_v3_cp2_ep2", "deepseek_v3_mtp_fsdp2"])
def test_deepseek_v3_layouts_match_one_process(runs: CaseResults, case: str) -> None:
    """The layouts, and with MTP modules their loss too (logged on its own: mtp_loss). Two steps of a mixture of
    experts need not lower the loss from one batch to the next (on torch 2.11 they do not)."""
    assert_same_run(runs, case, loss_falls=False)
    if "mtp" in case:
        got, ref = ([record["mtp_loss"] for record in runs[name]["metrics"] if "mtp_loss" in record]
                    for name in (case, LAYOUTS[case].reference))
        assert got and got == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("case", ["gpt_oss_cp2_ep2_selective_ac", "gpt_oss_pp2_full_ac", "gpt_oss_fsdp2_compiled"])
def test_gpt_oss_layouts_match_one_process(runs: CaseResults, case: str) -> None:
    """Windows, sinks and biased experts under each layout: context parallel's ring (its window masks and the sinks
    after the merge), the pipeline's stages (each block's own mask and its sinks' gradients), FSDP with compiled
    blocks."""
    assert_same_run(runs, case, loss_falls=False)


@pytest.mark.parametrize("case", ["muon_fsdp2", "muon_tp2", "muon_pp2", "muon_fsdp2_tp2", "muon_moe_ep2",
                                  "muon_moe_pp2", "muon_moe_ep2_fsdp2", "muon_moe_hsdp2_ep2", "muon_deepseek_v3_ep2",
                                  "muon_gpt_oss_ep2"])
def test_muon_matches_one_process(runs: CaseResults, case: str) -> None:
    """Muon's matrices gathered, orthogonalised and scattered back train as on one process: the losses to 1e-5, and
    the final weights. The gradients differ from one process's by reduction order (1e-7), which can move an element
    of the iteration's bfloat16 input across a rounding boundary, and the iteration spreads that over its row; in a
    mixture of experts the routers, under AdamW, then turn near-zero gradient differences into lr-sized steps. At most
    1.1% of any weight's elements end up apart by more than 1e-4 (and 1e-4 of their size), by at most 5e-4
    (measured, torch 2.11 and 2.13), where a wrong gather or owner would move most of them by about a step (1e-2)."""
    got, reference = runs[case], runs[LAYOUTS[case].reference]
    torch.testing.assert_close(got["losses"], reference["losses"], rtol=1e-5, atol=0)
    assert got["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
    assert got["weights"].keys() == reference["weights"].keys()
    for name, value in reference["weights"].items():
        apart = (got["weights"][name] - value).abs()
        outside = (apart > 1e-4 + 1e-4 * value.abs()).float().mean()
        assert apart.max() < 1e-3 and outside < 0.02, (name, apart.max().item(), outside.item())


@pytest.mark.parametrize("case", ["fsdp2_tp2"])
def test_fsdp_and_tp_on_four_processes(runs: CaseResults, case: str) -> None:
    assert_same_run(runs, case)


@pytest.mark.parametrize("case", [f"pp2_{schedule}" for schedule in PIPELINE_SCHEDULES], ids=list(PIPELINE_SCHEDULES))
def test_pipeline_schedules_match_one_process(runs: CaseResults, case: str) -> None:
    """4 micro-batches of 1 sequence through 2 pipeline ranks: the same losses and final weights as one process."""
    assert_same_run(runs, case, evaluated="--validation.no_enable" not in LAYOUTS[case].flags)


@pytest.mark.parametrize("case", ["pp2_accumulate"])
def test_pipeline_microbatches_compose_with_gradient_accumulation(runs: CaseResults, case: str) -> None:
    """Global batch 8 = 2 accumulation steps x 2 micro-batches of 2 sequences, against one process accumulating."""
    assert_same_run(runs, case)


@pytest.mark.parametrize("case", ["pp2_fsdp2", "pp2_tp2"])
def test_pipeline_with_fsdp_or_tp_on_four_processes(runs: CaseResults, case: str) -> None:
    assert_same_run(runs, case)


@pytest.mark.parametrize("case", ["cp2_allgather"], ids=["allgather"])
def test_context_parallel_matches_one_process(runs: CaseResults, case: str) -> None:
    """Each rank holds 2 of 4 load-balanced chunks of every sequence; attention exchanges keys and values."""
    assert_same_run(runs, case)


@pytest.mark.parametrize("case", ["fsdp2_causal", "pp2_causal", "cp2_causal"])
def test_causal_attention_matches_one_process(runs: CaseResults, case: str) -> None:
    """Attention across the documents of a window, as before block-causal masking became the default."""
    assert_same_run(runs, case)


@pytest.mark.parametrize("case", ["fsdp2_sft", "tp2_full_ac_sft", "pp2_sft", "cp2_alltoall_sft"])
def test_fine_tuning_on_conversations_matches_one_process(runs: CaseResults, case: str) -> None:
    """Packed conversations whose prompts carry no loss: every layout divides the step's loss by the same count of
    valid targets, however its ranks split them. TP with full AC and CP's all-to-all run here only."""
    assert_same_run(runs, case)


@pytest.mark.parametrize("case", ["cp2_fsdp2_full_ac"])
def test_context_parallel_with_fsdp_on_four_processes(runs: CaseResults, case: str) -> None:
    """FSDP shards over dp_shard x cp = 4 ranks; the loss averages over dp x cp; the blocks recompute in backward."""
    assert_same_run(runs, case)


@pytest.mark.parametrize("case", ["pp2_compiled_full_ac", "cp2_compiled_selective_ac"])
def test_pipeline_and_context_parallel_with_compile_and_ac(runs: CaseResults, case: str) -> None:
    """Compiled (aot_eager), checkpointed blocks inside pipeline stages, and around context-parallel attention (which
    dynamo traces through, collectives included): still one process's eager run."""
    assert_same_run(runs, case)


# One step of Trainer.run without clipping (it would rescale the gradients), probed by tests/harness/trainer_probe.py;
# no final evaluation: the probe reads the gradients as the training step left them.
PROBE = [*BASE, "--validation.no_enable", "--training.steps", "1", "--training.max_norm", "0",
         "--training.local_batch_size", "2"]
PROBE_PREFIX = "probe_"
"""Probes and parity cases share launches; this keeps their names apart."""
COMM_TIMEOUTS = ["--comm.init_timeout_seconds", "123", "--comm.train_timeout_seconds", "45"]
PROBES = {
    2: {"always_bf16_reduce": [*FSDP2, "--parallelism.fsdp_reshard_after_forward", "always",
                               "--training.mixed_precision_reduce", "bfloat16"],
        "never": [*FSDP2, "--parallelism.fsdp_reshard_after_forward", "never"],
        # 3 steps, each logged: the host reads of the step loop under expert parallel.
        "qwen3_moe_ep2": [*QWEN3_MOE, *EP2, "--training.steps", "3", "--metrics.log_freq", "1"]},
    # FSDP=2 x TP=2: the mesh's dimensions are groups smaller than the world, created apart from the default one.
    4: {"fsdp2_tp2_default": [*FSDP2, *TP2, *COMM_TIMEOUTS]},
}


@pytest.fixture(scope="module")
def probes(launched: CaseResults) -> CaseResults:
    """Every probe's result by its name in PROBES (run in the parity cases' launches)."""
    return CaseResults({name[len(PROBE_PREFIX):]: result for name, result in launched.results.items()
                        if name.startswith(PROBE_PREFIX)},
                       {name[len(PROBE_PREFIX):]: failure for name, failure in launched.failures.items()
                        if name.startswith(PROBE_PREFIX)})


@pytest.mark.parametrize("probe, blocks, root", [
    ("always_bf16_reduce", [True] * NUM_LAYERS, True),
    ("never", [False] * NUM_LAYERS, False),
    # default: every block but the last, whose backward starts right after forward; the root is used first in
    # backward, so it stays gathered too
    ("fsdp2_tp2_default", [True] * (NUM_LAYERS - 1) + [False], False),
], ids=["always", "never", "default"])
def test_fsdp_reshard_after_forward(probes: CaseResults, probe: str, blocks: list[bool], root: bool) -> None:
    """Right after forward, a block's parameters are back to FSDP shards exactly where the policy reshards."""
    assert probes[probe]["after_forward"] == {"blocks": blocks, "root": root}


def test_mixed_precision_reduce_bfloat16_rounds_gradients(probes: CaseResults) -> None:
    """Gradients reduced in bfloat16 (then stored in the float32 parameters' dtype) are bfloat16 values; the
    default float32 reduction keeps float32's finer mantissa."""
    def all_bfloat16(gradients: dict[str, torch.Tensor]) -> bool:
        return all(torch.equal(g, g.bfloat16().float()) for g in gradients.values())

    assert all(g.dtype == torch.float32 for g in probes["always_bf16_reduce"]["gradients"].values())
    assert all_bfloat16(probes["always_bf16_reduce"]["gradients"])
    assert not all_bfloat16(probes["never"]["gradients"])


def test_comm_timeouts_reach_every_process_group(probes: CaseResults) -> None:
    """--comm.init_timeout_seconds holds for setup and the first step, --comm.train_timeout_seconds (plus the margin
    that lets the hang watchdog fire first) after it, on the default group and on every mesh group that FSDP, TP and
    the loss average use."""
    groups = ["default", "pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "fsdp", "loss"]
    assert probes["fsdp2_tp2_default"]["setup_timeouts"] == dict.fromkeys(groups, 123)
    assert probes["fsdp2_tp2_default"]["train_timeouts"] == dict.fromkeys(groups, 45 + COLLECTIVE_TIMEOUT_MARGIN)

def test_expert_parallel_reads_the_split_sizes_once_per_layer(probes: CaseResults) -> None:
    """The step loop under expert parallel reads the device (HostReads, tests/harness/trainer_probe.py; its Readbacks
    aside) only where all-to-all takes its split sizes as Python ints, once per MoE layer and forward (the sizes to
    send and to receive together), on every EP rank: 3 steps x 6 layers. The loop's other reads: tests/test_train.py."""
    for rank, reads in enumerate(probes["qwen3_moe_ep2"]["host_reads"]):
        assert len(reads) == 3 * 6 and all("titan/parallel/ep.py" in read for read in reads), (rank, reads)


def run_losses(tmp_path: Path, *flags: str) -> list[float]:
    trainer = Trainer(load_job_config([*BASE, "--job.dump_folder", str(tmp_path), "--training.local_batch_size", "2",
                                       *flags], world_size=1), world_size=1)
    data = iter(trainer.dataloader)
    losses = []
    for _ in range(3):
        trainer.step += 1
        trainer.train_step(data)
        losses.append(trainer.finish_step().loss)
    return losses


def test_activation_checkpointing_modes_give_the_same_losses(tmp_path: Path) -> None:
    none = run_losses(tmp_path / "none")
    for name, flags in [("full", ["--activation_checkpoint.mode", "full"]),
                        ("op", ["--activation_checkpoint.mode", "selective"]),
                        ("every2", ["--activation_checkpoint.mode", "selective",
                                    "--activation_checkpoint.selective_ac_option", "2"])]:
        torch.testing.assert_close(run_losses(tmp_path / name, *flags), none, rtol=1e-6, atol=0, msg=name)


SMALL_MODEL = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=2256, max_seq_len=64)
# (mode, selective_ac_option) of the two layouts that checkpoint whole blocks.
WHOLE_BLOCK_AC = {"full": ("full", "op"), "every2": ("selective", "2")}


def build_small_model(ac: tuple[str, str, bool] | None, compiled: bool = False) -> Transformer:
    """A 4-block model checkpointed as `ac` says (mode, selective option, save_attention; None: no AC), then
    compiled if asked, in the trainer's order."""
    model = build_model(SMALL_MODEL)
    if ac is not None:
        apply_ac(model, *ac)
    if compiled:
        apply_compile(model, emulate_precision_casts=False)
    return model


def small_model_run(model: Transformer, steps: int = 1,
                    dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The losses of `steps` SGD steps of `model` on one batch under `dtype` autocast, and the last step's
    gradients by parameter name."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = torch.randint(0, SMALL_MODEL.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logits = model(batch[:, :-1])
        loss = cross_entropy_loss(logits, batch[:, 1:], SMALL_MODEL.vocab_size)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    # The checkpoint wrapper's prefix goes, as state_dict drops it: names then match an unwrapped model's.
    return losses, {name.replace(_CHECKPOINT_PREFIX, ""): p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", WHOLE_BLOCK_AC)
def test_saving_attention_outputs_gives_the_same_gradients(layout: str, dtype: torch.dtype) -> None:
    """Keeping the attention outputs instead of recomputing them runs the same ops on the same inputs: loss and
    gradients are bit-identical to no AC and to recomputing everything."""
    ref_losses, ref_grads = small_model_run(build_small_model(None), dtype=dtype)
    for save_attention in (True, False):
        losses, grads = small_model_run(build_small_model((*WHOLE_BLOCK_AC[layout], save_attention)), dtype=dtype)
        assert torch.equal(losses[0], ref_losses[0]), save_attention
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, ref_grads[name]), (save_attention, name)


def test_attention_is_kept_where_it_pays() -> None:
    """--activation_checkpoint.save_attention is honoured on CPU and under compile; eager GPU blocks recompute
    attention (the selective-checkpoint dispatch mode cost 0.69x-0.81x of the step on an H100)."""
    assert keeps_attention(True, compiled=False, on_gpu=False)
    assert keeps_attention(True, compiled=True, on_gpu=True)
    assert not keeps_attention(True, compiled=False, on_gpu=True)
    assert not any(keeps_attention(False, compiled, on_gpu) for compiled in (False, True) for on_gpu in (False, True))


def test_the_config_rules_know_which_blocks_record_their_ops() -> None:
    """records_ops, which the config rules read, says of each checkpointing mode what apply_ac does: whether the
    wrapped blocks run under a selective-checkpoint context (which records every op of the forward)."""
    for mode, option, keep_attention in itertools.product(("full", "selective"), ("op", "2"), (False, True)):
        with torch.device("meta"):
            model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=64, norm_eps=1e-5,
                                          rope_theta=10000.0, max_seq_len=8))
        apply_ac(model, mode, option, save_attention=keep_attention)
        contexts = [block.checkpoint_fn.keywords.get("context_fn") is not None for block in model.layers.values()
                    if hasattr(block, "checkpoint_fn")]
        assert any(contexts) == records_ops(mode, option, keep_attention), (mode, option, keep_attention)


@pytest.mark.parametrize(("mode", "option", "says_so"), [("full", "op", True), ("selective", "2", True),
                                                          ("selective", "op", False)])
def test_dropping_kept_attention_is_logged(mode: str, option: str, says_so: bool,
                                           titan_records: list[logging.LogRecord]) -> None:
    """When the eager-GPU rule overrides --activation_checkpoint.save_attention, the log says so; selective "op"
    AC keeps attention regardless, so there it says nothing."""
    cfg = load_job_config(["--activation_checkpoint.mode", mode, "--activation_checkpoint.selective_ac_option", option],
                          world_size=1)
    with torch.device("meta"):
        model = Transformer(SMALL_MODEL)
    dims = resolve_dims(cfg.parallelism, 1, cpu_offload=False)
    parallelize_model(model, FAMILIES["llama3"].parallel_plan, dims, None, cfg.parallelism, cfg.activation_checkpoint,
                      cfg.training, cfg.compile, keep_attention=False, block_causal=True)
    logged = any("Checkpointed blocks recompute attention" in record.getMessage() for record in titan_records)
    assert logged == says_so


@pytest.mark.parametrize("save_attention", [True, False])
def test_saving_attention_outputs_under_compile(save_attention: bool) -> None:
    """Compiled checkpointed blocks (the trainer compiles after AC) train as eager ones do, and inductor keeps
    the policy: with save_attention the attention kernel runs once per block in a step, else once more in
    backward. Compiled code is invisible to a TorchDispatchMode, so the profiler counts the kernel calls."""
    ac = (*WHOLE_BLOCK_AC["full"], save_attention)
    eager_losses, eager_grads = small_model_run(build_small_model(ac), steps=3)
    torch._dynamo.reset()
    compiled = build_small_model(ac, compiled=True)
    compiled_losses, compiled_grads = small_model_run(compiled, steps=3)
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-4, atol=1e-4)
    assert eager_losses[-1] < eager_losses[0]  # the weights moved, so equal later losses mean equal updates
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    with torch.profiler.profile() as prof:
        small_model_run(compiled)
    attention_calls = [e.name for e in prof.events()].count("aten::_scaled_dot_product_flash_attention_for_cpu")
    assert attention_calls == SMALL_MODEL.n_layers * (1 if save_attention else 2)


def test_wrong_degree_product_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        load_job_config([*BASE, "--parallelism.data_parallel_shard_degree", "2",
                         "--parallelism.tensor_parallel_degree", "2"], world_size=2)
    assert "must multiply to the world size 2" in str(err.value)


# How far step 1 of a low-precision layout may be from its one-process reference, relative.
FIRST_STEP_RTOL = {
    # Each FSDP rank scales its activations by the amax of its own 2 sequences, the reference by that of all 4; on
    # these batches that moves step 1 by 2.7e-4 relative.
    "fsdp2_float8": 1e-3,
    "tp2_float8": 1e-5,
    "fsdp2_mx": 1e-5,
    "tp2_mx": 1e-5,
    # Each CP rank scales its activations by the amax of its own half of every sequence (as torchao does: no
    # all-reduce per linear), so float8 rounding differs from step 1 on; measured 1.5e-4 relative.
    "cp2_float8": 1e-3,
    # Blockwise scales are per 128 elements of a token row or of a weight, whatever a rank's share of the batch; the
    # weight gradient's tiles down the tokens differ under CP (another mix of sequences), but only in the backward.
    "fsdp2_blockwise": 1e-5,
    "tp2_blockwise": 1e-5,
    "cp2_blockwise": 1e-5,
}


@pytest.mark.parametrize("case", FIRST_STEP_RTOL)
def test_low_precision_under_fsdp_tp_and_cp(runs: CaseResults, case: str) -> None:
    """Float8 weight scales come from global amaxes (DTensor reductions under TP, unsharded weights under FSDP);
    MX blocks never cross a TP shard (the converter checks it), so each rank's blocks are the global ones. Step 1
    matches one process to 1e-5, except where a rank scales activations by its own share of the batch: float8's
    per-tensor activation scales under FSDP and CP (MX's grad_weight blocks along tokens differ too, but only in
    the backward). After that, a 1e-7
    reduction-order difference can push a value across a rounding boundary (e4m3 steps are 2^-3 relative) and
    Adam turns near-zero gradient differences into lr-sized steps, so losses agree to 1e-3 and final weights are
    not compared element-wise."""
    got, reference = runs[case], runs[LAYOUTS[case].reference]
    torch.testing.assert_close(got["losses"][0], reference["losses"][0], rtol=FIRST_STEP_RTOL[case], atol=0)
    torch.testing.assert_close(got["losses"], reference["losses"], rtol=1e-3, atol=0)
    # Training moved far more than the 1e-3 agreement (0.008 nats): 2 steps take 0.1 nats off on torch 2.13.
    assert reference["losses"][-1] < reference["losses"][0] - 0.05


@pytest.mark.parametrize("case", ["tp2_nvfp4"])
def test_nvfp4_under_tensor_parallel_trains_as_one_process(runs: CaseResults, case: str) -> None:
    """NVFP4 on 2 TP ranks (sequence parallel), as torchao's NVFP4 tensor-parallel styles quantize: each weight shard
    with its own tensor scale, the gathered operands with the whole tensor's (tests/test_nvfp4.py checks the rule bit
    for bit). A shard's tensor scale moves its block scales' E4M3 rounding, and the gradients' stochastic rounding
    draws other noise than one process's: step 1 agrees to 2e-5 (measured 4e-6) and step 2 to 2e-3 (measured
    2e-4, 0.002 nats), where 2 steps take 0.09 nats off."""
    got, reference = runs[case], runs[LAYOUTS[case].reference]
    torch.testing.assert_close(got["losses"][0], reference["losses"][0], rtol=2e-5, atol=0)
    torch.testing.assert_close(got["losses"], reference["losses"], rtol=2e-3, atol=0)
    assert reference["losses"][-1] < reference["losses"][0] - 0.05


@pytest.mark.parametrize("case", ["fsdp2_bf16_state", "tp2_bf16_state"])
def test_bf16_optimizer_state_under_fsdp_and_tp(runs: CaseResults, case: str) -> None:
    """Moments in bfloat16 on FSDP- and TP-sharded (DTensor) parameters train like one process with bfloat16
    moments. The rounding bits are keyed by element index within a rank's shard, so a sharded run rounds other
    elements up than one process does and the runs are not bitwise equal: step 1 is (no update before it), and the
    losses after it agree to the moments' rounding (2^-9 relative, random), well under 1e-3."""
    got, reference = runs[case], runs[LAYOUTS[case].reference]
    assert got["losses"][0] == pytest.approx(reference["losses"][0], rel=1e-6)
    torch.testing.assert_close(got["losses"], reference["losses"], rtol=1e-3, atol=0)
    # Training moved far more than the 1e-3 agreement (0.008 nats): 2 steps take 0.1 nats off on torch 2.13.
    assert reference["losses"][-1] < reference["losses"][0] - 0.05


@pytest.mark.parametrize("case", ["tp2_bf16_state"])
def test_bf16_optimizer_state_keeps_tp_replicated_parameters_identical(runs: CaseResults, case: str) -> None:
    """What the rounding bits are keyed by counters for (titan/train/bf16_state.py): the parameters TP replicates
    (the norms) get the same gradient on both TP ranks, so the same update with the same rounding keeps their copies
    bit for bit equal after every step. Bits drawn from a generator, or keyed by rank, would let them drift apart."""
    first, second = runs[case]["replicated_by_tp_rank"]
    assert first.keys() == second.keys() and any(name.endswith("attention_norm.weight") for name in first)
    for name, value in first.items():
        assert torch.equal(value, second[name]), f"{name} differs between the TP ranks"
    initial_norm = torch.ones_like(first["norm.weight"])  # RMSNorm weights start at 1: the update moved them
    assert not torch.equal(first["norm.weight"], initial_norm)


@pytest.mark.parametrize("case", ["qwen3_moe_low_precision_ep2", "qwen3_moe_low_precision_ep2_fsdp2",
                                  "deepseek_v3_low_precision_ep2", "deepseek_v3_low_precision_ep2_fsdp2",
                                  "gpt_oss_low_precision_ep2_fsdp2", "qwen3_moe_blockwise_ep2_fsdp2"])
def test_experts_in_low_precision_match_one_process(runs: CaseResults, case: str) -> None:
    """Each rank quantizes the tokens its experts receive from every EP rank, which are one process's tokens of
    those experts in the same order, so each expert's scales and products are one process's: the losses agree to
    1e-5. The gradients reaching the experts differ from one process's by reduction-order noise (1e-7), which can
    move a value across a float8 rounding boundary (e4m3 steps are 2^-3 relative) and Adam turns such a near-zero
    gradient difference into an lr-sized step: at most 0.8% of any weight's elements end up more than 1e-4 apart
    (measured), where a wrong expert, gradient or update would move most of them. Blockwise experts write their
    products and gradients in bf16 (torchao's emulation), whose 2^-9 steps such noise crosses more often: 2.3%
    (measured)."""
    got, reference = runs[case], runs[LAYOUTS[case].reference]
    torch.testing.assert_close(got["losses"], reference["losses"], rtol=1e-5, atol=0)
    assert got["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
    most_apart = 0.05 if "blockwise" in case else 0.02
    for name, value in reference["weights"].items():
        apart = ((got["weights"][name] - value).abs() > 1e-4).float().mean().item()
        assert apart < most_apart, (name, apart)
    assert all(record["grad_norm"] > 0 for record in reference["metrics"])


@pytest.mark.parametrize("case", ["qwen3_moe_fsdp2_selective_ac", "deepseek_v3_pp3_selective_ac",
                                  "deepseek_v3_pp2_ep2_full_ac"])
def test_experts_in_checkpointed_blocks_count_and_balance_as_one_process(runs: CaseResults, case: str) -> None:
    """Losses, weights (the routing biases with them) and every logged step's expert load equal one process's. Each
    MoE layer counts each of a step's 4 x 64 tokens' top-k routed copies once, recomputed or not; before, the counts
    of a rank whose blocks were checkpoint-wrapped kept what to_empty() left in them (1e30 and negative counts on
    the CPU, a NaN bias for good on a GPU), and a recomputed block counted twice. Under the pipeline, rank 0 writes
    metrics.jsonl and holds only the dense block 0: it takes part in the balancer's all-reduce (before, it skipped
    it and gloo aborted on the mismatched collectives) and reports every MoE layer's load, under the model's FQNs
    in model order."""
    assert_same_run(runs, case, loss_falls=False)
    got, reference = runs[case]["metrics"], runs[LAYOUTS[case].reference]["metrics"]
    assert [record["step"] for record in got] == [record["step"] for record in reference] == [1, STEPS]
    family, flavor = ("qwen3", "debugmodel_moe") if "qwen3" in case else ("deepseek_v3", "debugmodel")
    top_k = FAMILIES[family].flavors[flavor].moe.top_k
    for record, reference_record in zip(got, reference, strict=True):
        assert record["tokens_per_expert"] == reference_record["tokens_per_expert"]
        assert record["moe_imbalance"] == reference_record["moe_imbalance"]
        assert all(sum(counts) == 4 * 64 * top_k for counts in record["tokens_per_expert"].values())
    if "deepseek_v3" in case:
        assert list(got[0]["tokens_per_expert"]) == ["layers.1", "layers.2"]


GPU_ONLY_FEATURES = {"flex attention"}
"""Features no CPU runs (torch has no FlexAttention backward on the CPU): CI's dry run of every shipped config at its
documented world size (scripts/dry_run_configs.py) runs them on its fake CUDA tensors instead."""


def features(cfg: JobConfig, world_size: int) -> set[str]:
    """What a job turns on, of what the parity cases must combine: its model's kind, its activation checkpointing,
    each parallelism it applies (FSDP wherever FSDP2 wraps the model, over data or context-parallel ranks), its
    converters, the experts' load balancing, and FlexAttention."""
    dims = resolve_dims(cfg.parallelism, world_size, cfg.training.enable_cpu_offload)
    moe = getattr(FAMILIES[cfg.model.name].flavors[cfg.model.flavor], "moe", None)
    ac = cfg.activation_checkpoint
    found = {"mixture of experts" if moe is not None else "dense"}
    if ac.mode == "full" or ac.mode == "selective":
        found.add(f"{ac.mode} AC" if ac.mode == "full" or ac.selective_ac_option != "op" else "selective AC by op")
    found |= {name for name, on in (("FSDP", dims.dp_enabled), ("HSDP", dims.dp_replicate > 1), ("TP", dims.tp_enabled),
                                    ("PP", dims.pp_enabled), ("CP", dims.cp_enabled), ("EP", dims.ep_enabled)) if on}
    found |= set(cfg.model.converters)
    if moe is not None and cfg.moe.load_balance_coeff > 0:
        found.add("expert balancing")
    if cfg.model.attn_backend == "flex":
        found.add("flex attention")
    return found


def test_every_pair_of_features_a_shipped_config_combines_has_a_parity_case() -> None:
    """For every shipped config at its documented world size, each two features it turns on run together in some
    parity case above, so that a bug that needs both (issue 50's, MoE with activation checkpointing under FSDP, EP
    and PP) fails on the CPU; what only a GPU runs is covered by CI's dry run of the config. Pairs, not whole
    tuples: the 671B config's would need more ranks than CI has."""
    # Parsed, not validated: the parity cases and the configs are validated where they run.
    covered = [features(parse_args([*BASE, *layout.flags]), layout.nprocs) for layout in LAYOUTS.values()
               if layout.reference is not None]
    missing = {}
    for config in CONFIGS:
        turned_on = features(load_toml(config), documented_world_size(config))
        for pair in itertools.combinations(sorted(turned_on - GPU_ONLY_FEATURES), 2):
            if not any(set(pair) <= case for case in covered):
                missing.setdefault(pair, []).append(config.name)
    assert not missing, "no parity case combines: " + "; ".join(f"{' + '.join(pair)} ({', '.join(configs)})"
                                                               for pair, configs in sorted(missing.items()))


class Stop(Exception):
    """Raised by a forward pre-hook once it has seen a unit's inputs: the test needs them, not the forward."""


def inputs_as_the_unit_sees_them(unit: torch.nn.Module, run: Callable[[], object]) -> list[torch.dtype]:
    """The dtypes of the floating-point tensors `unit` receives when `run` calls it, after FSDP's pre-forward (the
    hook is registered after fully_shard's, so it runs after any cast FSDP makes)."""
    seen: list[torch.dtype] = []

    def record(module: torch.nn.Module, args: tuple) -> None:
        seen.extend(arg.dtype for arg in args if isinstance(arg, torch.Tensor) and arg.is_floating_point())
        raise Stop

    handle = unit.register_forward_pre_hook(record)
    try:
        with pytest.raises(Stop):
            run()
    finally:
        handle.remove()
    return seen


def test_fsdp_units_take_their_inputs_as_given_under_bf16_parameters(tmp_path: Path) -> None:
    """--training.mixed_precision_param bfloat16 gathers parameters in bf16 but must not cast what a unit is given:
    FSDP's default (cast_forward_inputs) would round the float32 rotary table to bf16 at every block, and the
    experts' unit's inputs likewise. One rank, so that the units are real FSDP units on this CPU."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        args = replace(QWEN3_FLAVORS["debugmodel_moe"], n_layers=1, vocab_size=256)
        model = Qwen3(args)
        init_qwen3(model)
        (experts,) = block_experts(model, "moe.experts").values()
        apply_expert_fsdp(model, mesh, "moe.experts", torch.bfloat16, torch.float32)
        apply_fsdp(model, mesh, torch.bfloat16, torch.float32, reshard_after_forward="default")
        tokens = torch.randint(0, args.vocab_size, (1, 16))
        # The block: bf16 hidden states from the embedding, and the float32 rotary table as built.
        block_inputs = inputs_as_the_unit_sees_them(model.layers["0"], lambda: model(tokens))
        assert block_inputs == [torch.bfloat16, torch.float32]
        x = torch.randn(16, args.dim)
        counts = torch.full((args.moe.num_experts,), 2, dtype=torch.int64)
        assert inputs_as_the_unit_sees_them(experts, lambda: experts(x, counts)) == [torch.float32]
    finally:
        dist.destroy_process_group()
