"""The step budget: what a GPU runs for one transformer block of a training job, counted on the CPU. The block's
forward, selective checkpointing's recompute and backward run on the dry run's simulated GPU (fake CUDA tensors,
titan/estimate/fake_cuda.py; the process must have loaded the compiled shim first, titan/estimate/cuda_shim.py)
under the dry run's recorder (titan/estimate/trace.py), and every op that moves data is a kernel: its bytes, its
FLOPs, and its roofline time at the card's achieved rates (titan/estimate/roofline.py). scripts/step_budget.py prints
Titan's budget beside torchtitan's for the same job.

The dry run turns compile off and stands causal SDPA in for FlexAttention; a budget has to see what an eager block
on a GPU does with FlexAttention instead, which is a region compiled on its own. flex_region stands in for it: one
fused attention kernel each way (SDPA's flash kernels, causal, so FLOPs as trace.py counts them), which selective
checkpointing either sees as one op and saves, or cannot see and so runs again in the recompute, as the region's
compile options (wrap_inductor_compiled_regions) and the policy's save list decide. Block-causal masks skip more
blocks than causal ones; both frameworks are priced alike."""

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from unittest import mock

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

from titan.estimate.fake_cuda import simulated_gpu
from titan.estimate.roofline import GPUS, OpCost, op_seconds
from titan.estimate.trace import StepRecorder
from titan.hardware import SIMULATED_GPUS
from titan.models.common import attention
from titan.models.common.family import BuildOptions
from titan.models.families import FAMILIES
from titan.parallel import ac

aten = torch.ops.aten


@dataclass(frozen=True)
class BudgetJob:
    """The job a budget prices: a Llama 3 flavor's block over local_batch_size x seq_len tokens in bf16 (FSDP's
    mixed precision), selective per-op checkpointing, block-causal FlexAttention."""

    flavor: str = "1B"
    local_batch_size: int = 2
    seq_len: int = 8192
    vocab_size: int = 2256
    """The shipped tokenizer's: it only sizes the embedding and output, which a block does not hold."""


JOBS = {"1B": BudgetJob()}
"""The jobs scripts/step_budget.py knows: scripts/gpu_check.py's TITAN_1B_JOB."""


@dataclass(frozen=True)
class BlockBudget:
    """One block's forward, recompute and backward on a GPU: kernels launched, the bytes that kernels other than
    matmuls and attention move, matmul and attention FLOPs (recompute included), and the roofline time."""

    framework: str
    gpu: str
    n_layers: int
    kernels: int
    non_matmul_bytes: int
    matmul_flops: float
    attention_flops: float
    seconds: float
    """The block's predicted time at `gpu`'s achieved rates: the sum of its kernels' roofline times."""
    kernels_by_op: dict[str, int]
    """Kernels by aten op name (a custom op's own name), for a listing."""

    @property
    def step_seconds(self) -> float:
        """The blocks' share of a step: n_layers blocks."""
        return self.seconds * self.n_layers

    def to_dict(self) -> dict:
        return asdict(self)


def block_budget(framework: str, gpu: str, n_layers: int, ops: list[OpCost]) -> BlockBudget:
    """The budget of a block whose recorded kernels are `ops`."""
    spec = GPUS[gpu]
    return BlockBudget(
        framework=framework, gpu=gpu, n_layers=n_layers, kernels=len(ops),
        non_matmul_bytes=sum(op.bytes for op in ops if not op.flops),
        matmul_flops=sum(op.flops for op in ops if not op.attention),
        attention_flops=sum(op.flops for op in ops if op.attention),
        seconds=sum(op_seconds(op, spec) for op in ops),
        kernels_by_op=dict(sorted(Counter(op.name for op in ops).items())))


@contextlib.contextmanager
def hidden_from_checkpointing() -> Iterator[None]:
    """Ops run here are invisible to selective checkpointing, as a compiled region's kernels are to its policy
    without wrap_inductor_compiled_regions: its dispatch mode is popped (the recorder under it still sees them), so
    nothing is saved and the recompute runs them again."""
    if isinstance(_get_current_dispatch_mode(), (_CachingTorchDispatchMode, _CachedTorchDispatchMode)):
        with _pop_mode_temporarily():
            yield
    else:
        yield


def flex_region(q: Tensor, k: Tensor, v: Tensor, visible: bool) -> tuple[Tensor, Tensor]:
    """A compiled FlexAttention region as a GPU runs it, q (bs, heads, seq, head_dim), k and v (bs, kv_heads, seq,
    head_dim) -> (out like q, logsumexp (bs, heads, seq)): one causal flash kernel forward, its backward in backward;
    `visible` to selective checkpointing as one op, which a policy that saves attention keeps, or hidden from it."""
    with contextlib.nullcontext() if visible else hidden_from_checkpointing():
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[:2]
    return out, lse


def titan_flex_region(q: Tensor, k: Tensor, v: Tensor, block_mask: object = None, enable_gqa: bool = False,
                      **kwargs: object) -> Tensor:
    """flex_region in place of Titan's compiled_flex_attention(): saved where its compile options make the region
    visible to selective checkpointing and the policy saves compiled regions (titan/parallel/ac.py SAVE_ALWAYS), as
    on a GPU; otherwise run again in the recompute."""
    visible = bool(attention.VISIBLE_REGION_OPTIONS.get("wrap_inductor_compiled_regions"))
    saved = visible and torch.ops.higher_order.inductor_compiled_code in ac.SAVE_ALWAYS
    assert not saved or aten._scaled_dot_product_flash_attention.default in ac.SAVE_ALWAYS, \
        "the stand-in is saved by the flash kernel's entry in SAVE_ALWAYS"
    return flex_region(q, k, v, visible=saved)[0]


def bf16_parameters(module: nn.Module) -> None:
    """The module's parameters in bf16, as FSDP's mixed precision gathers them (buffers keep their dtype)."""
    for parameter in module.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)


@contextlib.contextmanager
def on_simulated_gpu(gpu: str) -> Iterator[FakeTensorMode]:
    """The dry run's simulated `gpu` ("H100", "H200", "B200"): CUDA allocations, such as a meta-built module's
    to_empty("cuda"), make fake tensors of the mode it yields, for a forward to run under."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    accelerator = SIMULATED_GPUS[gpu]
    with simulated_gpu(accelerator.name, accelerator.capability, fake_mode):
        yield fake_mode


def record_block(run: Callable[[], Tensor]) -> list[OpCost]:
    """The kernels of `run()` (a block's forward, returning its output) and of its backward (from an output gradient
    made before, which is not the block's work)."""
    with StepRecorder({}) as recorder:
        out = run()
        recorder.paused = True
        grad = torch.ones_like(out)
        recorder.paused = False
        out.backward(grad)
    return recorder.ops


def titan_block_kernels(job: BudgetJob, gpu: str = "H100") -> list[OpCost]:
    """The kernels of Titan's block of `job` as scripts/gpu_check.py's TITAN_1B_JOB runs it: Llama 3 `job.flavor` with
    FlexAttention (compiled on its own, flex_region), selectively checkpointed by op (titan/parallel/ac.py), its
    parameters in bf16 and its rotary rows gathered per document (block-causal positions), in float32."""
    family = FAMILIES["llama3"]
    args = family.build_args(job.flavor, BuildOptions(vocab_size=job.vocab_size, vocab_size_multiple_of=64,
                                                      max_seq_len=job.seq_len, attn_backend="flex"))
    shape = (job.local_batch_size, job.seq_len)
    with on_simulated_gpu(gpu) as fake_mode, mock.patch.object(attention, "compiled_flex_attention",
                                                                 lambda: titan_flex_region):
        with torch.device("meta"):
            model = family.model(replace(args, n_layers=1))
        model.to_empty(device="cuda")
        with fake_mode:
            bf16_parameters(model)
            ac.apply_ac(model, "selective", "op", save_attention=False)
            x = torch.empty(*shape, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            positions = torch.zeros(shape, dtype=torch.int64, device="cuda")
            rope = model.rope(positions)[args.layer_attention(0).rope]  # (bs, seq, head_dim // 2, 2)
            block = model.layers["0"]
            return record_block(lambda: block(x, rope, None))
