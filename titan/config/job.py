"""JobConfig: one dataclass per TOML table. Field docstrings are the `--help` text.

Precedence: these defaults < the TOML file given by --job.config_file < command-line flags.
"""

from dataclasses import dataclass, field
from typing import Literal

from titan.config.domain import (
    Count,
    CountOrAuto,
    Decay,
    FiniteFloat,
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    OptionalCount,
    OptionalFraction,
    OptionalPositiveFloat,
    PositiveFloat,
    Seed,
    StepOrLatest,
)
from titan.models.families import FAMILIES

FamilyName = Literal[tuple(FAMILIES)]
"""The registered model families (titan/models/families.py): registering one there adds it here."""
FlavorName = Literal[tuple(dict.fromkeys(flavor for family in FAMILIES.values() for flavor in family.flavors))]
"""Every registered family's flavors: validation checks that the flavor is one of --model.name's."""

# float16 would need loss scaling, which Titan does not do; bfloat16 has float32's range.
DTypeName = Literal["float32", "bfloat16"]


@dataclass
class Job:
    config_file: str | None = None
    """TOML job file to read before command-line flags are applied. None: defaults only."""
    dump_folder: str = "./outputs"
    """Folder for everything a run writes: config.toml, metrics.jsonl, TensorBoard logs, traces."""
    description: str = "Titan training job"
    """Free text naming the job; printed at startup and saved with the config."""
    print_config: bool = False
    """Print the resolved config as TOML and exit, building and training nothing; on any machine: what this one lacks
    to run the job (files, a GPU) follows as warnings. A run always writes it to <dump_folder>/config.toml."""
    time_limit: str | None = None
    """Wall-clock budget of this run from the trainer's start, e.g. 3h50m, 90m or 45s (set it a little under the
    scheduler's limit). When the next step would cross it (from the measured step time and the last save's duration),
    every rank saves a checkpoint and the run exits with code 4; rerunning the same command resumes. None: no limit."""
    dry_run: bool = False
    """Don't train: simulate this job at its world size on fake tensors (no GPU, no data, no files read or written)
    and print each simulated rank's predicted memory, FLOPs, collective volume and step time (see [estimate] and
    docs/scale.md). run_train.sh simulates rank 0 and the last rank in one process, whatever NGPU is."""


@dataclass
class Estimate:
    gpu: Literal["H100", "H200", "B200"] = "H100"
    """GPU the dry run's roofline step time and the memory headroom are for (SXM parts: dense bf16 peak, HBM
    size and bandwidth, NVLink bandwidth from NVIDIA's datasheets, scaled by the shares of those peaks that a
    training step's kernels reached on an H100; docs/scale.md)."""
    gpus_per_node: Count = 8
    """GPUs per node: collectives among ranks of one node use NVLink, the others the inter-node network."""
    inter_node_bandwidth_gbs: PositiveFloat = 50.0
    """Inter-node bandwidth per GPU in GB/s, one direction: 50 is one 400 Gb/s InfiniBand NDR NIC per GPU."""
    nvlink_bandwidth_gbs: OptionalPositiveFloat = None
    """Intra-node bandwidth per GPU in GB/s, one direction. None: the GPU's NVLink (450 for H100/H200, 900 for B200)."""


@dataclass
class Model:
    name: FamilyName = "llama3"
    """Model family to build: one that titan/models/families.py registers (each family's folder in titan/models
    describes it)."""
    flavor: FlavorName = "debugmodel"
    """Model size within the family: one of the flavors in its args.py, whose debug flavors (debugmodel and its
    variants) train on CPU. A name that is no flavor of --model.name is an error that lists the family's flavors."""
    tokenizer_path: str = "tokenizers/titan_2256.tiktoken"
    """Tokenizer file: tiktoken format (base64 token and rank per line, e.g. Llama 3's tokenizer.model), or a Hugging
    Face tokenizer.json of a byte-level BPE (Qwen3's, GPT-2's, Llama 3's), read with the tokenizer_config.json next
    to it for its BOS. Documents end with the EOS (<|endoftext|> where the file has it)."""
    vocab_size_multiple_of: Count = 64
    """Pad the embedding and output rows up to a multiple of this, so float8 and TP can split them.
    Padded ids are never targets and are dropped from logits returned to users."""
    converters: list[str] = field(default_factory=list)
    """Model converters applied after the model is built: `float8`, `mx`, `nvfp4`. Accepts a list
    (`--model.converters float8 mx`) or comma-separated names (`float8,mx`)."""
    print_after_conversion: bool = False
    """Print the model after converters ran, to check which layers were swapped."""
    attn_backend: Literal["sdpa", "flex"] = "sdpa"
    """Attention kernel: sdpa (torch's scaled_dot_product_attention: the flash kernel for causal attention, a dense
    (seq x seq) boolean mask for block_causal; CPU and GPU) or flex (FlexAttention: skips the masked blocks, the
    fastest block-causal kernel; CUDA only, since torch has no FlexAttention backward on CPU)."""
    attn_mask_type: Literal["causal", "block_causal"] = "block_causal"
    """What a token attends to: block_causal (Llama 3's recipe: the earlier tokens of its own document, rotary
    positions restarting at each document's BOS, and no loss on predicting the next document's BOS) or causal (every
    earlier token of the packed sequence, across documents)."""


@dataclass
class MoE:
    load_balance_coeff: NonNegativeFloat = 1e-3
    """Auxiliary-loss-free load balancing (DeepSeek-V3, torchtitan's default): after every optimizer step each
    expert's routing bias moves by this much, up for experts that got fewer tokens than the mean and down for the
    others; the bias steers which experts a token picks, not their weights. 0: no bias. Mixture-of-experts flavors
    only."""
    aux_loss_weight: NonNegativeFloat = 0.0
    """Weight of the load-balancing loss (Switch Transformer's, as Qwen3-MoE computes it) of each MoE layer, added
    to the gradient but not to the reported loss. Qwen3-MoE was trained with 0.001 (its router_aux_loss_coef).
    0: no such loss. Mixture-of-experts flavors only."""


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam", "Muon", "DistMuon"] = "AdamW"
    """Optimizer. AdamW decouples weight decay from the gradient; Adam adds it to the gradient. Muon
    orthogonalises the momentum of each hidden weight matrix (Newton-Schulz) and trains every other parameter with
    AdamW; under FSDP, TP and EP each matrix is gathered whole on one rank of its shard group (docs/optimizers.md).
    DistMuon is torchtitan's name for the same."""
    lr: PositiveFloat = 8e-4
    """Peak learning rate, reached at the end of warmup."""
    beta1: Decay = 0.9
    """Adam first-moment decay."""
    beta2: Decay = 0.95
    """Adam second-moment decay."""
    eps: PositiveFloat = 1e-8
    """Adam denominator epsilon."""
    weight_decay: NonNegativeFloat = 0.1
    """Weight decay coefficient, for the weight matrices (and for norms, biases and embeddings as the next two fields
    say)."""
    decay_norm_and_bias: bool = False
    """Also decay norm weights and biases (every 1-D parameter). Off by default, as in OLMo's and nanoGPT's
    pretraining recipes: decaying a norm's gain toward 0 only fights the scale the next layer needs."""
    decay_embeddings: bool = False
    """Also decay the token embedding. Off by default, as in OLMo's recipe: each row is updated only when its token
    appears, so decay shrinks rare tokens' rows between their updates."""
    lr_multipliers: list[str] = field(default_factory=list)
    """Learning-rate multipliers by parameter FQN, as FQN_SUBSTRING=FACTOR (`--optimizer.lr_multipliers
    tok_embeddings=0.5 output=2`): a parameter whose FQN contains the substring trains at FACTOR x the scheduled
    learning rate (the first match counts). Empty: every parameter at the schedule's rate."""
    state_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of Adam's two moments. bfloat16 halves the optimizer state (4 bytes per parameter instead of 8): the
    update runs in float32 and the moments are stored with stochastic rounding, so increments smaller than
    bfloat16's spacing are kept on average (titan/train/bf16_state.py). Its own kernel: --optimizer.implementation
    does not apply. Parameters and gradients keep their dtypes. Adam and AdamW only: Muon keeps one float32
    momentum per matrix element, half of Adam's state already."""
    momentum: Decay = 0.95
    """Muon: the momentum's decay (torch.optim.Muon's `momentum`): buffer = momentum x buffer + (1 - momentum) x
    gradient."""
    nesterov: bool = True
    """Muon: orthogonalise Nesterov's look-ahead, (1 - momentum) x gradient + momentum x buffer, rather than the
    buffer."""
    ns_steps: Count = 5
    """Muon: Newton-Schulz iterations per matrix and step."""
    ns_a: FiniteFloat = 3.4445
    """Muon: a of the quintic Newton-Schulz iteration X <- a X + b (X X^T) X + c (X X^T)^2 X (torch.optim.Muon's
    ns_coefficients (a, b, c); the defaults are Keller Jordan's). Coefficients under which the iteration takes [0, 1]
    out of bounds are a config error."""
    ns_b: FiniteFloat = -4.7750
    """Muon: b of the Newton-Schulz iteration (--optimizer.ns_a)."""
    ns_c: FiniteFloat = 2.0315
    """Muon: c of the Newton-Schulz iteration (--optimizer.ns_a)."""
    ns_eps: PositiveFloat = 1e-7
    """Muon: floor of the Frobenius norm a matrix is divided by before Newton-Schulz (torch.optim.Muon's `eps`)."""
    adjust_lr_fn: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Muon: how a matrix's learning rate follows its shape. match_rms_adamw (Moonlight's, 0.2 x sqrt(max(rows,
    cols))) gives the update AdamW's RMS, so one --optimizer.lr and schedule serve the Muon and AdamW parameters;
    original (Keller Jordan's, sqrt(max(1, rows / cols))) wants a Muon rate of its own, about 0.02."""
    adamw_fqns: list[str] = field(default_factory=list)
    """Muon: FQN substrings of weight matrices to train with AdamW instead (`--optimizer.adamw_fqns wo w2`). The
    embedding, the output projection, norms, biases, attention sinks and the MoE routers always train with AdamW."""
    implementation: Literal["for-loop", "foreach", "fused"] = "fused"
    """Optimizer kernel: fused (one kernel updates every parameter; foreach on a device torch has no fused Adam
    kernel for), foreach (multi-tensor ops), for-loop (one parameter at a time). Only fused skips a step's update
    on the device (--training.on_nonfinite, --training.on_spike); with the others the host waits for each step's
    verdict before its update. Under Muon it is the AdamW parameters' kernel: the matrices' update is Muon's own,
    which always skips on the device."""


@dataclass
class LRScheduler:
    warmup_steps: NonNegativeInt = 200
    """Steps of linear warmup from near zero to --optimizer.lr."""
    decay_ratio: OptionalFraction = None
    """Fraction of all steps spent decaying at the end of training (WSD schedule). None: decay over
    every step after warmup; 0: no decay (constant after warmup)."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay from the peak down to the floor."""
    min_lr_factor: Fraction = 0.0
    """Floor of the decay, as a fraction of --optimizer.lr (0.1 ends at lr/10)."""


@dataclass
class Training:
    dataset: Literal["shipped", "text", "jsonl", "hf", "chat", "prepared"] = "shipped"
    """Data source: shipped (the small corpus in titan/data/corpus/), text or jsonl files given by
    --training.dataset_path, a Hugging Face dataset (needs the `hf` extra), conversations to fine-tune on (chat:
    rendered by a chat template, the [chat] section; docs/sft.md), or a token store made by
    `python -m titan.data.prepare`. All but prepared are tokenized into a store on first use (in
    --training.dataset_cache_dir) and read from it after."""
    dataset_path: str | None = None
    """A file, folder or glob for text/jsonl data (text: blank lines separate documents; jsonl: one object
    per line with a "text" field); the dataset name or folder for hf; JSONL files or a Hugging Face dataset folder
    for chat (a list of messages per row); the store's folder for prepared. Unused for shipped."""
    dataset_cache_dir: str = ""
    """Folder for the token stores made on first use (under its token_stores/). Empty: $TITAN_CACHE_DIR, else
    ~/.cache/titan."""
    shuffle: bool = True
    """Visit each source's windows in a new seeded order every epoch (from --training.seed, the epoch and the data);
    off: in the order of the documents."""
    local_batch_size: Count = 8
    """Sequences per device per micro-step."""
    global_batch_size: CountOrAuto = -1
    """Sequences per optimizer step over all data-parallel ranks. Larger than local_batch_size times
    the data-parallel degree means gradient accumulation. -1: no accumulation."""
    seq_len: Count = 2048
    """Tokens per sequence."""
    max_norm: FiniteFloat = 1.0
    """Clip the global gradient norm to this value. 0 or less: no clipping (the norm is still reported)."""
    steps: Count = 10000
    """Optimizer steps to train."""
    mixed_precision_param: DTypeName = "bfloat16"
    """Dtype that matmuls and activations run in. float32 turns mixed precision off."""
    mixed_precision_reduce: DTypeName = "float32"
    """Dtype of gradient reduction across data-parallel ranks."""
    enable_cpu_offload: bool = False
    """Keep FSDP's sharded parameters, their gradients and the optimizer state in host memory (torch's
    CPUOffloadPolicy): each block's shard is copied to the GPU for its all-gather, gradients are copied back, and the
    optimizer step runs on the CPU. Frees those bytes on the GPU at the cost of host-device traffic and a CPU
    optimizer step every step. Applies FSDP over a one-rank mesh where the data-parallel degree is 1 (one GPU
    training a model that does not fit it otherwise). The weights are initialised from a full copy of the model on
    the GPU, which must fit there once (titan/parallel/init.py)."""
    mtp_loss_weight: NonNegativeFloat = 0.3
    """Weight of the multi-token prediction loss (the MTP modules' mean cross entropy over their depths) in the
    gradient, for flavors with MTP modules (deepseek_v3 debugmodel_mtp, 671B_mtp): DeepSeek-V3 trained with 0.3, then
    0.1 for its last 4.8T tokens. It is logged on its own as mtp_loss; the reported loss stays the next-token loss."""
    loss_chunk_size: NonNegativeInt = 1024
    """Tokens per chunk of the output layer and cross entropy: logits, their fp32 log-softmax and gradients exist
    for one chunk at a time, never for the whole micro-batch (the same loss; the output layer's forward runs once
    more in the backward). 0: the whole micro-batch at once. Under tensor parallel, tokens per chunk of each
    rank's sequence shard."""
    seed: Seed = 42
    """Seed for weight init and for the --training.mixture draws; the same seed gives the same losses."""
    deterministic: bool = False
    """Use deterministic algorithms only (slower on GPU; CPU runs are deterministic anyway)."""
    mixture: list[str] = field(default_factory=list)
    """Several weighted data sources instead of --training.dataset: each is DATASET[:PATH]=WEIGHT, with DATASET one of
    shipped, text, jsonl, hf, prepared (`--training.mixture shipped=1 jsonl:data/code.jsonl=3`; in TOML also a list of
    tables, `mixture = [{dataset = "shipped", weight = 1}, {dataset = "jsonl", path = "data/code.jsonl", weight = 3}]`).
    Each sequence comes from one source, drawn with probability proportional to its weight (from --training.seed and the
    sequence's index, so every layout and a resumed run draw alike); a source that runs out starts over. Empty: the
    single source of --training.dataset."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """What a non-finite loss or gradient norm does: stop the run (exit 3), or skip that step's update (no optimizer
    or LR-schedule step; the data moves on) and record it in <dump_folder>/anomalies.jsonl."""
    max_skipped_steps: Count = 10
    """Steps that may be skipped or rolled back, non-finite or spiking, counted over resumes too; the next one stops
    the run (exit 3): by then the problem is not one bad batch."""
    on_spike: Literal["log", "skip", "rollback"] = "log"
    """What a loss spike does: log it (and record it in <dump_folder>/anomalies.jsonl), skip that step's update, or
    reload the last checkpoint and skip the batches between it and the spike (needs --checkpoint.enable; before the
    first checkpoint the step is skipped)."""
    spike_window: Count = 100
    """Recent applied steps whose losses define the typical loss. Spikes are detected once the window is full."""
    spike_threshold: PositiveFloat = 6.0
    """A step is a spike when its loss exceeds the median of the last spike_window losses by more than this many
    median absolute deviations (the deviation is floored at 1% of the median, so a flat loss never flags noise)."""
    gc_freq: Count = 50
    """Python's garbage collector runs every this many steps, on every rank at the same step, and never on its own
    during training: an automatic collection pauses one rank at a random moment, and at scale every rank waits for
    it. Each pause is in the metrics (gc_pause_s). Lower it if host memory grows between collections."""


@dataclass
class Validation:
    enable: bool = False
    """Evaluate the loss on held-out data every --validation.freq steps and at the last step (logged as val_loss
    and val_perplexity at that training step)."""
    dataset: Literal["shipped", "text", "jsonl", "hf", "chat", "prepared"] = "shipped"
    """Evaluation data: shipped (the held-out 1 in 20 documents of the shipped corpus, which training never
    reads), or text, jsonl, hf, chat or prepared data given by --validation.dataset_path, read as --training.dataset
    reads it (in document order, never shuffled)."""
    dataset_path: str | None = None
    """A file, folder or glob (text, jsonl, chat), a dataset name or folder (hf, chat) or a store's folder
    (prepared). Unused for shipped."""
    freq: Count = 100
    """Training steps between evaluations."""
    steps: CountOrAuto = -1
    """Batches per evaluation. -1: one pass over the whole set (every rank evaluates the same number of batches:
    the last incomplete global batch is left out)."""
    local_batch_size: OptionalCount = None
    """Sequences per device per evaluation batch. None: --training.local_batch_size."""
    seq_len: OptionalCount = None
    """Tokens per evaluation sequence, at most --training.seq_len. None: --training.seq_len."""


@dataclass
class Chat:
    template_path: str = ""
    """The chat template that renders conversations (chat data): a Jinja file, or a tokenizer_config.json to take
    its chat_template from. Empty: the tokenizer's, from the tokenizer_config.json (or chat_template.jinja) beside a
    tokenizer.json, or Titan's default for a tiktoken file (titan/data/templates/; docs/sft.md)."""
    messages_field: str = "messages"
    """The field of each row (a JSONL object's key, a dataset's column) that holds its list of {"role", "content"}
    messages."""
    train_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    """Which tokens of a conversation carry the loss: assistant (every assistant turn, from the template's
    {% generation %} blocks, else found by rendering message by message), last_assistant (only its last assistant
    turn), or all (every token, prompts included)."""


@dataclass
class Metrics:
    log_freq: Count = 10
    """Log metrics every this many steps (and at the first and last step)."""
    enable_tensorboard: bool = False
    """Also write metrics as TensorBoard events under <dump_folder>/<save_tb_folder>."""
    save_tb_folder: str = "tb"
    """TensorBoard folder inside the dump folder."""
    disable_color_printing: bool = False
    """Print console metrics without ANSI colours (they are only used when stdout is a terminal)."""
    straggler_threshold: Fraction = 0.7
    """Name a rank, once, in a warning with its host, when its relative performance (the median rank's optimizer-step
    time over its own, each the median over the last --metrics.straggler_window logged steps) falls below this; 0.7
    is NVIDIA's resiliency extension's default. The optimizer step is timed because no collective runs in it: a
    whole step takes every rank of a synchronous job the same time, the fast ones waiting for the slow one. 0: off."""
    straggler_window: Count = 5
    """Logged steps whose optimizer-step times --metrics.straggler_threshold compares (their median, per rank)."""
    enable_wandb: bool = False
    """Also log metrics, evaluations and anomalies to Weights & Biases (the wandb extra: pip install -e ".[wandb]").
    W&B's environment picks the project (WANDB_PROJECT, default titan), entity, run name (default: the dump
    folder's), group and mode (WANDB_MODE=offline writes <dump_folder>/wandb for `wandb sync`); a resumed run
    continues the same W&B run."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces (Chrome trace JSON) every --profiling.profile_freq steps."""
    save_traces_folder: str = "profile_traces"
    """Trace folder inside the dump folder; one subfolder per profiled step."""
    profile_freq: Count = 10
    """Profile one step out of this many (the profiler warms up on the steps before it)."""
    enable_memory_snapshot: bool = False
    """Dump a CUDA memory snapshot (pickle for pytorch.org/memory_viz) every profile_freq steps. CUDA only."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder inside the dump folder."""


@dataclass
class Comm:
    init_timeout_seconds: Count = 300
    """Timeout for process-group setup and the first collectives."""
    train_timeout_seconds: Count = 100
    """Longest a training step, or the logging, checkpoint save or evaluation after it, may take once the first step is
    done. Past it, every rank writes its Python stacks to <dump_folder>/hang/rank_<r>.txt and its flight recorder's
    collectives (--comm.trace_buf_size) to <dump_folder>/<save_traces_folder>, and the run exits with code 5, naming
    the slowest rank. Collectives time out 30 s later than this."""
    trace_buf_size: NonNegativeInt = 20000
    """Collectives that torch's flight recorder keeps per rank (a ring buffer, for NCCL and gloo groups alike): on a
    hang each rank writes what it last ran and what it waits in, for `python -m torch.distributed.flight_recorder.
    fr_trace`. 0: off."""
    save_traces_folder: str = "comm_traces"
    """Folder under --job.dump_folder for the flight recorder's dumps: rank_<r> (NCCL) and gloo_rank_<r> (gloo)."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: Count = 1
    """Replicas of the model across groups of ranks (HSDP's outer dimension: gradients all-reduced between
    replicas). 1: no replication."""
    data_parallel_shard_degree: CountOrAuto = -1
    """Ranks that shard parameters, gradients and optimizer state with FSDP2. -1: every rank left over
    after replicate and tensor-parallel degrees."""
    tensor_parallel_degree: Count = 1
    """Ranks that split each layer's matmuls (Megatron-style, with sequence parallel on the norms). Keep it
    within one node: it communicates every layer."""
    force_fsdp: bool = False
    """Apply FSDP2 also where the data-parallel degree is 1, over a one-rank mesh: a single GPU then runs the sharded
    (DTensor) code of multi-GPU jobs, e.g. to check it on one card. --training.enable_cpu_offload does this by itself,
    since offload is FSDP's."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: always (least memory), never (no re-gather in backward, more
    memory), default (every block but the last, whose backward comes right after forward; under pipeline and expert
    parallel, a mixture of experts' experts, an FSDP unit of their own, stay gathered between micro-batches, as the
    schedule keeps them after backward)."""
    disable_loss_parallel: bool = False
    """With tensor parallel, gather the vocab-sharded logits before the loss instead of computing the loss
    on the shards (more memory and traffic; for debugging)."""
    enable_async_tensor_parallel: bool = False
    """Overlap tensor-parallel communication with matmuls (micro-pipelining). Needs CUDA and --compile.enable."""
    pipeline_parallel_degree: Count = 1
    """Ranks that each hold a slice of the layers (pipeline stages) and pass activations on to the next. The
    outermost dimension: it communicates least, so it is the one to span nodes. 1: no pipeline."""
    pipeline_parallel_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                                        "ZBVZeroBubble"] = "1F1B"
    """torch.distributed.pipelining schedule. GPipe and 1F1B run one stage per rank; Interleaved1F1B, LoopedBFS and
    InterleavedZeroBubble run several (looped, a smaller bubble); ZBVZeroBubble runs exactly two per rank in a V."""
    pipeline_parallel_microbatch_size: Count = 1
    """Sequences per pipeline micro-batch: --training.local_batch_size is split into local_batch_size / this many
    micro-batches, which keep the stages busy (more micro-batches, a smaller bubble)."""
    pipeline_parallel_layers_per_stage: OptionalCount = None
    """Transformer blocks per pipeline stage; the number of stages is the layer count over it, and stages per rank
    follow (several for looped schedules). None: one stage per rank (two for looped schedules), blocks spread
    evenly with any remainder on the middle stages."""
    pipeline_parallel_split_points: list[str] = field(default_factory=list)
    """Uneven stages: the first block of every stage but the first, e.g. "layers.3" "layers.7" for three stages.
    The first stage also holds the embedding and the last the norm, output and loss, so they often want fewer
    blocks. Empty: set by pipeline_parallel_layers_per_stage."""
    expert_parallel_degree: Count = 1
    """Ranks that split each mixture-of-experts layer's experts (each holds num_experts / degree of them) and send
    every token to the ranks of its experts and back (all-to-all). It borrows its ranks from data parallel: the
    degree must divide data_parallel_shard_degree x context_parallel_degree, and the experts are FSDP-sharded over
    the ranks left over. 1: every rank holds every expert. Mixture-of-experts flavors only."""
    context_parallel_degree: Count = 1
    """Ranks that split each sequence (for long contexts): every rank holds 2 of 2 x degree chunks, one from the
    start and one from the end, so causal attention work is balanced. 1: no context parallel."""
    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """How context-parallel ranks exchange keys and values: allgather (all at once) or alltoall (passed around a
    ring, one chunk at a time: less memory)."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward to save memory: none, full (every transformer block), or selective
    (see selective_ac_option)."""
    selective_ac_option: str = "op"
    """With mode selective: "op" saves matmul and attention outputs and recomputes the cheap ops in between;
    an integer k checkpoints every k-th block fully ("2": half the blocks)."""
    save_attention: bool = True
    """With mode full or selective k: checkpointed blocks keep each attention output (and the TP reduce-scatter
    outputs) instead of recomputing them in backward, since attention is the costliest op to recompute. Costs per
    checkpointed block about one more tensor the size of the block's input, (batch, seq, dim); three with tensor
    parallel. false recomputes everything: the least memory, e.g. for very long contexts. Selective "op" always
    keeps them. In eager mode on a GPU blocks recompute attention whatever this says: keeping it there runs a Python
    dispatch mode over every op of the block, which costs more than it saves (--compile.enable keeps it)."""


@dataclass
class Float8:
    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise"] = "tensorwise"
    """Scale granularity (torchao's recipes): tensorwise, one scale per tensor (fastest); rowwise, one power-of-2
    scale per row of each operand (more accurate, slower); rowwise_with_gw_hp, power-of-2 scales per row, one
    for the weight in grad_input, and the weight-gradient matmul in high precision (most accurate); blockwise,
    DeepSeek-V3's: a scale per 1 x 128 tile of activations and gradients and per 128 x 128 block of weights (native
    on Hopper only; layers whose dims are not multiples of 128 stay in high precision). Per-operand table:
    docs/float8.md."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Keep linears whose FQN contains one of these substrings in high precision. Default: the vocab-sized
    output projection (accuracy-sensitive). Pass the flag with no value to convert it too."""
    emulate: bool = False
    """Quantize, but run matmuls in high precision. Works on CPU and pre-SM89 GPUs; for tests, not speed."""
    moe_fqns_prototype: list[str] = field(default_factory=lambda: ["experts"])
    """Convert the grouped experts of mixture-of-experts layers whose FQN contains one of these substrings (e.g.
    "experts", every MoE layer's): their grouped matmuls run in float8 with the recipe's scales (per expert for the
    weights). Natively on Hopper (SM90) or newer, else with --float8.emulate. Pass the flag with no value to keep
    the experts in high precision."""
    auto_filter_small_kdims: bool = False
    """Also skip linears too small to gain from float8 (torchao's published size thresholds per recipe)."""
    enable_fsdp_float8_all_gather: bool = False
    """All-gather FSDP weights in float8 instead of high precision (half the traffic of bf16). Tensorwise only."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """With the float8 all-gather: compute every weight's scale in one fused step after the optimizer step,
    instead of one small all-reduce per layer."""


CHECKPOINT_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
"""Top-level parts of a checkpoint, as --checkpoint.exclude_from_loading names them."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints every --checkpoint.interval steps and at the last step, and resume from the latest
    complete one in --checkpoint.folder when the run starts."""
    folder: str = "checkpoint"
    """Folder for checkpoints, under --job.dump_folder, or an fsspec URL used as given (s3://bucket/run,
    gs://bucket/run; credentials and endpoint from the backend's environment, e.g. AWS_*); each step is a
    subfolder step-<N>."""
    interval: Count = 500
    """Steps between checkpoints."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """disabled: training waits for the whole save. async: training waits only while the state is copied to host
    memory; files are written in a background thread. async_with_pinned_mem: the same copy into pinned host
    memory (faster device-to-host copies; CUDA only)."""
    keep_latest_k: NonNegativeInt = 10
    """Keep the newest k complete checkpoints and delete older ones. 0: keep all."""
    load_step: StepOrLatest = -1
    """Step to resume from. -1: the latest complete checkpoint in --checkpoint.folder."""
    initial_load_path: str | None = None
    """Checkpoint to start from when --checkpoint.folder holds none yet: a step folder of another run (or its
    checkpoint folder, for its latest complete step) or a seed checkpoint, a path or an fsspec URL; with
    --checkpoint.initial_load_in_hf a local Hugging Face safetensors folder. Read with or without --checkpoint.enable,
    which only decides whether this run saves and resumes checkpoints of its own."""
    initial_load_model_only: bool = True
    """From --checkpoint.initial_load_path load the weights only (a fresh optimizer, schedule and data order)."""
    initial_load_in_hf: bool = False
    """--checkpoint.initial_load_path is a Hugging Face model folder of --model.name's family (config.json +
    safetensors: LlamaForCausalLM, Qwen3ForCausalLM or Qwen3MoeForCausalLM)."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """Parts of a checkpoint not to restore on resume: any of model, optimizer, lr_scheduler, dataloader,
    train_state, rng (e.g. `dataloader` to restart the data with a new dataset)."""
    last_save_model_only: bool = False
    """Make the checkpoint of the last step a weights-only export in --checkpoint.export_dtype (smaller, but a
    run cannot be extended from it)."""
    last_save_in_hf: bool = False
    """Write the checkpoint of the last step as a Hugging Face model folder instead (safetensors shards with their
    index, config.json and the tokenizer, in --checkpoint.export_dtype), straight from the sharded model: it loads
    with transformers' from_pretrained as the family's class (LlamaForCausalLM, Qwen3ForCausalLM or
    Qwen3MoeForCausalLM). Weights only, so a run cannot be extended from it. With
    a URL --checkpoint.folder the folder is assembled under --job.dump_folder/checkpoint_staging, then uploaded."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the weights in a --checkpoint.last_save_model_only or --checkpoint.last_save_in_hf export."""
    create_seed_checkpoint: bool = False
    """Initialise the model on one process, save it as step 0 and exit; later runs at any scale with this
    --checkpoint.folder start from exactly these weights."""


@dataclass
class MX:
    recipe_name: Literal["mxfp8", "mxfp8_rceil"] = "mxfp8"
    """MX recipe: E4M3 elements in blocks of 32 sharing one E8M0 (power-of-two) scale, in all three matmuls of every
    converted linear and of the converted experts (OCP Microscaling spec v1.0). mxfp8 rounds the scale down (the
    spec's floor: a block's largest element may saturate); mxfp8_rceil rounds amax / 448 up (torchao's and
    torchtitan's default: nothing saturates). docs/mx.md."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Keep linears whose FQN contains one of these substrings in high precision. Default: the vocab-sized
    output projection (accuracy-sensitive). Pass the flag with no value to convert it too."""
    emulate: bool = False
    """Quantize to MX, but run matmuls in high precision. Native MX needs an NVIDIA GPU with compute capability
    10.0+ (Blackwell); emulate runs the same numerics on CPU and older GPUs, for tests, not speed."""
    moe_fqns_prototype: list[str] = field(default_factory=lambda: ["experts"])
    """Convert the grouped experts of mixture-of-experts layers whose FQN contains one of these substrings (e.g.
    "experts", every MoE layer's): their grouped matmuls run in MXFP8, blocks of 32 along each matmul's contraction
    dim. Pass the flag with no value to keep the experts in high precision."""


@dataclass
class NVFP4:
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Keep linears whose FQN contains one of these substrings in high precision. Default: the vocab-sized
    output projection (accuracy-sensitive). Pass the flag with no value to convert it too."""
    high_precision_last_blocks_fraction: Fraction = 0.15
    """Keep the last ceil(n_layers x this) transformer blocks in high precision, the most precision-sensitive ones
    (torchtitan's NVFP4 recipe: 5 of Llama 3 8B's 32 blocks at 0.15). 0: convert every block."""
    emulate: bool = False
    """Quantize to NVFP4, but run matmuls in high precision. Native NVFP4 needs an NVIDIA GPU with compute
    capability 10.0+ (Blackwell); emulate runs the same numerics on CPU and older GPUs, for tests, not speed."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block and the loss. --training.compile, Titan's earlier spelling, is an alias
    of this field (on the command line, and as [training] compile in a TOML file)."""
    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """torch.compile's backend: inductor generates fused kernels (the speed); aot_eager traces the forward and backward
    graphs as inductor would but runs them with eager kernels, and eager only captures the graphs with dynamo. The
    last two compile in a fraction of inductor's time: for telling a graph-capture problem from a kernel one."""
    emulate_precision_casts: bool = False
    """Make inductor round intermediates to their dtype as eager does (inductor's emulate_precision_casts).
    Fixes NaN losses seen with float8 rowwise + torch.compile + RMSNorm; slightly slower."""


FaultKind = Literal["none", "kill", "hang", "sigstop", "storage", "slow", "random"]


@dataclass
class Fault:
    kind: FaultKind = "none"
    """Inject a fault, to test recovery (--max-restarts) on a cluster; nothing is injected unless asked, and the log
    says when it is. kill: SIGKILL --fault.rank. hang: --fault.rank sleeps in its training thread, so its peers wait in
    their next collective and the watchdog ends the attempt with code 5. sigstop: --fault.rank stops itself (SIGSTOP;
    its own watchdog stops too, its peers' fire). storage: the local checkpoint folder is swapped for a file for
    --fault.storage_seconds, so that saves fail (a read-only folder would not stop root). slow: --fault.rank's
    optimizer steps take --fault.slow_seconds longer from then on (a straggler). random: a kill, hang or
    sigstop of a random rank, at random times --fault.mean_interval_seconds apart on average."""
    rank: NonNegativeInt = 0
    """The rank that fails (kill, hang, sigstop), or that swaps the checkpoint folder (storage)."""
    step: NonNegativeInt = 0
    """Inject at the end of this step, after it trained and before its checkpoint is saved. 0: at
    --fault.after_seconds instead."""
    after_seconds: NonNegativeFloat = 0.0
    """Inject this many seconds after the attempt's first step ended (with --fault.step 0)."""
    storage_seconds: PositiveFloat = 60.0
    """How long the storage fault lasts, in seconds."""
    slow_seconds: PositiveFloat = 0.1
    """What the slow fault adds to each optimizer step of --fault.rank, in seconds."""
    mean_interval_seconds: PositiveFloat = 60.0
    """Mean time between random faults, in seconds of training (exponentially distributed, as in Clockwork's
    benchmark)."""
    seed: Seed = 0
    """Seed of the random faults' times, ranks and kinds (each attempt draws its own)."""
    every_attempt: bool = False
    """Inject again in each restarted attempt (to spend a restart budget). Off: only the first attempt of a launch,
    so that a restart recovers. Random faults always draw anew in each attempt."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    moe: MoE = field(default_factory=MoE)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    validation: Validation = field(default_factory=Validation)
    chat: Chat = field(default_factory=Chat)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    float8: Float8 = field(default_factory=Float8)
    mx: MX = field(default_factory=MX)
    nvfp4: NVFP4 = field(default_factory=NVFP4)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    compile: Compile = field(default_factory=Compile)
    estimate: Estimate = field(default_factory=Estimate)
    fault: Fault = field(default_factory=Fault)
