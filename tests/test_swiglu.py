"""SwiGLU's fused gate (titan/models/common/swiglu.py): the CPU path is the unfused expression exactly, forward and
backward; the Triton kernels are within one rounding of float64, interpreted on the CPU and on a GPU when one is
here; the custom ops' fake and autograd registrations pass torch's checks."""

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from titan.models.common.swiglu import silu_gate, swiglu, swiglu_backward

from harness.triton_interpreter import run_interpreted

# Sizes that leave a partial last block of the kernels, in 1-D, 2-D and 3-D.
SHAPES = [(3000,), (37, 129), (2, 5, 1031)]


def inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> list[Tensor]:
    """a (wide enough that sigmoid saturates both ways), b and the output's gradient."""
    generator = torch.Generator().manual_seed(seed)
    a, b, grad = (torch.randn(shape, generator=generator) for _ in range(3))
    return [(4 * a).to(dtype).to(device), b.to(dtype).to(device), grad.to(dtype).to(device)]


def reference(a: Tensor, b: Tensor, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """silu(a) * b and its gradients with respect to a and b, in float64 from the same inputs."""
    a, b, grad = a.double(), b.double(), grad.double()
    sigmoid = torch.sigmoid(a)
    return a * sigmoid * b, grad * b * sigmoid * (1 + a * (1 - sigmoid)), grad * a * sigmoid


def check_kernels_match_reference(device: str) -> None:
    """The Triton kernels against float64: bf16 within one ulp (2^-7 relative; on a GPU they round to nearest, the
    interpreter truncates), fp16 correctly rounded but where float32's own error meets a tie, fp32 within its error."""
    from titan.models.common.swiglu_kernels import swiglu_backward_kernel, swiglu_forward

    for shape in SHAPES:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            a, b, grad = inputs(shape, dtype, device)
            grad_a, grad_b = swiglu_backward_kernel(grad, a, b)
            for got, want in zip((swiglu_forward(a, b), grad_a, grad_b), reference(a, b, grad)):
                got, want = got.cpu(), want.cpu()
                assert got.dtype == dtype and got.shape == want.shape
                if dtype == torch.bfloat16:
                    assert ((got.double() - want).abs() <= want.abs() * 2**-7 + 1e-30).all()
                elif dtype == torch.float16:
                    assert (got != want.to(dtype)).float().mean() < 1e-3
                else:
                    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_triton_kernels_match_float64_interpreted() -> None:
    pytest.importorskip("triton")
    run_interpreted("test_swiglu", "check_kernels_match_reference('cpu')")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the interpreted test covers the kernels")
def test_triton_kernels_match_float64_cuda() -> None:
    check_kernels_match_reference("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_gate_is_the_expression_forward_and_backward(dtype: torch.dtype) -> None:
    """On the CPU the op and its backward give the unfused expression's outputs and gradients bit for bit, so the
    CPU suite's losses do not move."""
    for shape in SHAPES:
        a, b, grad = inputs(shape, dtype)
        fused = [t.clone().requires_grad_() for t in (a, b)]
        plain = [t.clone().requires_grad_() for t in (a, b)]
        out = silu_gate(*fused)
        want = F.silu(plain[0]) * plain[1]
        out.backward(grad)
        want.backward(grad)
        assert torch.equal(out, want)
        assert torch.equal(fused[0].grad, plain[0].grad) and torch.equal(fused[1].grad, plain[1].grad)


def test_gate_gradients_pass_gradcheck_and_the_ops_pass_opcheck() -> None:
    a, b = (torch.randn(4, 7, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(swiglu, (a, b))
    a, b, grad = inputs((5, 9), torch.float32)
    torch.library.opcheck(swiglu, (a.requires_grad_(), b.requires_grad_()))
    torch.library.opcheck(swiglu_backward, (grad, a.detach(), b.detach()))


def test_gate_takes_the_expression_where_it_is_traced_or_the_shapes_differ() -> None:
    """Under torch.compile the expression (inductor fuses it with its neighbours); a broadcast b, which the
    kernels do not take, too. Both equal the expression."""
    a, b, _ = inputs((6, 8), torch.float32)
    graphs: list[torch.fx.GraphModule] = []

    def capture(graph: torch.fx.GraphModule, example_inputs: list[Tensor]) -> torch.fx.GraphModule:
        graphs.append(graph)
        return graph

    compiled = torch.compile(silu_gate, backend=capture, fullgraph=True)
    torch.testing.assert_close(compiled(a, b), F.silu(a) * b, rtol=0, atol=0)
    (graph,) = graphs
    targets = {node.target for node in graph.graph.nodes if node.op == "call_function"}
    assert F.silu in targets and torch.ops.titan.swiglu.default not in targets
    assert torch.equal(silu_gate(a, b[:1]), F.silu(a) * b[:1])
