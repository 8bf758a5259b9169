"""Every Triton kernel Titan launches compiles to a cubin for the GPUs it targets (sm_90 Hopper for float8, sm_100
Blackwell for MX), on this CPU-only machine: Triton compiles ahead of time without a GPU. The numerics tests run the
kernels under TRITON_INTERPRET=1, which accepts code that real compilation rejects: the MX kernel read a plain
Python global, which only failed once it was compiled on an H100. So this test captures the launches the real
launchers make (CPU tensors, nothing runs) and hands each one, with its argument types, constexprs and launch options
(num_warps, num_stages, ...), to the compiler."""

import itertools
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from unittest.mock import patch

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from titan.quant.kernels.float8_cast import triton_rowwise_cast, triton_tensorwise_cast  # noqa: E402
from titan.quant.kernels.mx_quantize import triton_quantize  # noqa: E402

POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.uint8: "*u8"}
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
INPUT_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the kernel, its arguments by name, and the launch options given with them (num_warps,
    num_stages, ...: the keywords that are not the kernel's parameters), which the compiled variant depends on."""

    kernel: JITFunction
    arguments: dict
    options: dict


def captured_launches(launch: Callable[[], object]) -> list[Launch]:
    """The kernels `launch()` starts; captured instead of run."""
    launches = []

    def capture(kernel: JITFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> None:
        arguments = dict(zip(kernel.arg_names, args))
        arguments.update((name, value) for name, value in kwargs.items() if name in kernel.arg_names)
        options = {name: value for name, value in kwargs.items() if name not in kernel.arg_names}
        launches.append(Launch(kernel, arguments, options))

    with patch.object(JITFunction, "run", capture):
        launch()
    return launches


def argument_type(value: object) -> str:
    """Triton's type for a runtime argument, as its JIT specializes it (ints that fit 32 bits are i32)."""
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    assert isinstance(value, float), f"no Triton type for {value!r}"
    return "fp32"


def compile_source(kernel: JITFunction, arguments: dict) -> ASTSource:
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = arguments[param.name]
        signature[param.name] = "constexpr" if param.is_constexpr else argument_type(value)
        if param.is_constexpr:
            constexprs[param.name] = value
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs)


def every_launch() -> dict[str, Launch]:
    """One launch per distinct (kernel, argument types, constexprs, options) the launchers make, for bf16 and fp32
    inputs."""
    x = torch.randn(64, 256)
    launchers = []
    for input_dtype, float8 in itertools.product(INPUT_DTYPES, FLOAT8):
        source = x.to(input_dtype)
        for power_of_2 in (False, True):
            launchers.append(partial(triton_tensorwise_cast, source, float8, power_of_2))
            launchers += [partial(triton_rowwise_cast, source, float8, dim, power_of_2) for dim in (0, -1)]
        launchers += [partial(triton_quantize, source, 32, float8, dim, rounding) for dim in (0, -1)
                      for rounding in ("floor", "rceil")]
    distinct = {}
    for launcher in launchers:
        for launch in captured_launches(launcher):
            source = compile_source(launch.kernel, launch.arguments)
            key = (launch.kernel.__name__, tuple(source.signature.items()), tuple(sorted(source.constants.items())),
                   tuple(sorted(launch.options.items())))
            call = ", ".join([f"{launcher.args[0].dtype} x", *map(str, launcher.args[1:])])
            distinct.setdefault(key, (f"{launch.kernel.__name__} from {launcher.func.__name__}({call})", launch))
    return dict(distinct.values())


LAUNCHES = every_launch()


def test_every_kernel_is_launched() -> None:
    names = {launch.kernel.__name__ for launch in LAUNCHES.values()}
    assert names == {"_partial_amax_kernel", "_tensorwise_cast_kernel", "_rowwise_cast_kernel", "_mx_quantize_kernel"}


def compile_failure(launch: Launch, capability: int) -> str | None:
    """Why `launch`'s kernel does not compile to a cubin for compute capability `capability`; None if it does."""
    try:
        compiled = triton.compile(compile_source(launch.kernel, launch.arguments),
                                  target=GPUTarget("cuda", capability, 32), options=launch.options)
        assert compiled.asm["cubin"], "empty cubin"
    except Exception as error:  # noqa: BLE001 - every kernel's failure is reported, not just the first
        return f"{type(error).__name__}: {str(error)[-600:]}"
    return None


def compile_failure_by_name(name: str, capability: int) -> str | None:
    return compile_failure(LAUNCHES[name], capability)


@pytest.mark.parametrize("capability", [90, 100], ids=["sm_90", "sm_100"])
def test_kernels_compile_to_cubin(capability: int) -> None:
    # Two kernels at a time, in two forked processes: each compile waits mostly on ptxas. Not in threads: Triton
    # parses each kernel's source with Python's ast in the calling thread, and CPython 3.11's ast constructor is not
    # thread-safe ("SystemError: AST constructor recursion depth mismatch" failed a run that compiled two kernels in
    # two threads). Forked workers find LAUNCHES as the parent built it; only names and messages cross.
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("fork")) as pool:
        outcomes = dict(zip(LAUNCHES, pool.map(compile_failure_by_name, LAUNCHES, [capability] * len(LAUNCHES))))
    failures = [f"{name}: {failure}" for name, failure in outcomes.items() if failure is not None]
    assert not failures, "\n".join(failures)
