"""The grouped matmuls' scale layouts (titan/quant/mx/blocked.py) byte for byte against torchao's torch references,
which torchao's Triton and CUDA layout kernels for its SM100 MXFP8 grouped matmuls are written to match; and their
shapes against torch._scaled_grouped_mm's meta check, on fake CUDA tensors.

torchao's references read the group offsets on the host (.tolist()); Titan's layouts must not, and the fake-tensor
test shows they don't: fake tensors have no values, so a host read raises there. Needs torchao (the `test` extra);
torchao prints "Failed to load ..._C_mxfp8..." on import on CPU: its CUDA extensions, which nothing here uses.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torchao.prototype.moe_training.kernels.mxfp8.quant import (
    torch_to_blocked_2d_K_groups,
    torch_to_blocked_2d_M_groups,
    torch_to_blocked_per_group_3d,
)

from titan.quant.mx.blocked import to_blocked_k_groups, to_blocked_m_groups, to_blocked_per_expert

GROUP_SIZES = [
    pytest.param([0, 32, 96, 160], id="sizes-0-32-96-160"),
    pytest.param([160, 0, 96, 32, 0], id="sizes-160-0-96-32-0"),
]
"""Rows per group, multiples of 32 as the padded token layout makes them: empty groups (first, inside, last), groups
under one tile (32, 96) and over one (160), so groups pad by 96, 32 and 96 rows to their next tile."""
TRAILING_ROWS = 64
"""Rows after the last group, as the padded token layout has: no group holds them, so no layout may."""


def random_codes(*shape: int) -> Tensor:
    generator = torch.Generator().manual_seed(0)
    # Codes 1..254: no zero, so a byte that should hold padding and holds a scale shows.
    return torch.randint(1, 255, shape, dtype=torch.uint8, generator=generator)


def end_offsets(group_sizes: list[int]) -> Tensor:
    return torch.tensor(group_sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def assert_equal_then_zeros(got: Tensor, want: Tensor) -> None:
    """`got` is sized by a bound rounded to whole tiles, torchao's by the same bound unrounded; both zero-fill.
    Equal over torchao's bytes, which hold every group's region, and zeros after them."""
    got, want = got.flatten(), want.flatten()
    assert got.numel() >= want.numel()
    assert torch.equal(got[:want.numel()], want)
    assert not got[want.numel():].any()


@pytest.mark.parametrize("rows, num_scale_cols", [(160, 3), (128, 4), (96, 6)])
def test_per_expert_layout_is_torchaos(rows: int, num_scale_cols: int) -> None:
    """Expert weights' scales (E, rows, K / 32): the same shape and bytes as torchao's, rows and scale columns
    padded (160 -> 256, 3 -> 4 for K = 96)."""
    codes = random_codes(3, rows, num_scale_cols)
    assert torch.equal(to_blocked_per_expert(codes), torch_to_blocked_per_group_3d(codes))


@pytest.mark.parametrize("num_scale_cols", [3, 4, 6])
@pytest.mark.parametrize("group_sizes", GROUP_SIZES)
def test_m_groups_layout_is_torchaos(group_sizes: list[int], num_scale_cols: int) -> None:
    """Groups of rows. torchao's reference writes each group's tiles into a (rows, K / 32) buffer, which only fits
    when K / 32 is a multiple of 4: it gets the codes zero-padded to whole tiles' columns, the zeros to_blocked pads
    with. Its buffer is rows + num_groups * 128 rows, Titan's that rounded up to a whole tile."""
    codes = random_codes(sum(group_sizes) + TRAILING_ROWS, num_scale_cols)
    offsets = end_offsets(group_sizes)
    want, _ = torch_to_blocked_2d_M_groups(F.pad(codes, (0, -num_scale_cols % 4)), offsets)
    got = to_blocked_m_groups(codes, offsets)
    assert got.shape[1] == want.shape[1]
    assert_equal_then_zeros(got, want)


@pytest.mark.parametrize("rows", [96, 160, 256])
@pytest.mark.parametrize("group_sizes", GROUP_SIZES)
def test_k_groups_layout_is_torchaos(group_sizes: list[int], rows: int) -> None:
    """Groups along the tokens, the contraction dim of grad_weight: 0, 1, 3 and 5 scale columns, padded to 0, 4, 4
    and 8. torchao's buffer has tokens / 32 + num_groups * 4 columns, Titan's that rounded up to a whole tile; the
    kernel reads group g from round_up(rows, 128) * (torchao's start column of g), all inside torchao's bytes."""
    codes = random_codes(rows, (sum(group_sizes) + TRAILING_ROWS) // 32)
    offsets = end_offsets(group_sizes)
    want, start_cols = torch_to_blocked_2d_K_groups(codes, offsets // 32)
    got = to_blocked_k_groups(codes, offsets)
    assert got.shape[0] == want.shape[0] == -(-rows // 128) * 128
    assert start_cols[-1] * got.shape[0] <= want.numel()
    assert_equal_then_zeros(got, want)


def fake_e4m3(*shape: int, column_major: bool = False) -> Tensor:
    """Fake CUDA E4M3 data, row-major or (as mat_b must be) column-major in its last two dims."""
    if column_major:
        return torch.empty(*shape[:-2], shape[-1], shape[-2], dtype=torch.float8_e4m3fn, device="cuda").mT
    return torch.empty(*shape, dtype=torch.float8_e4m3fn, device="cuda")


def on_fake_cuda(scales: Tensor) -> Tensor:
    """A fake CUDA E8M0 tensor with the shape and strides of the fake CPU `scales`. The layouts are built on CPU: on a
    CPU-only torch, Python indexing and Tensor.to of a CUDA tensor initialize CUDA, even a fake one (the dry run's
    simulated GPU provides that; a plain FakeTensorMode does not)."""
    return torch.empty_strided(scales.shape, scales.stride(), dtype=torch.float8_e8m0fnu, device="cuda")


def test_layouts_pass_the_grouped_mm_meta_check() -> None:
    """The three grouped matmuls of experts with weights W (E, N, K) on tokens x (rows, K), with their scales in
    Titan's layouts, through torch._scaled_grouped_mm's meta check on fake CUDA tensors (a CPU-only torch runs it).
    K = 96 gives 3 scale columns per row, padded to 4. The layouts are built from fake offsets, which have no values,
    so none of them reads the offsets on the host. A weight scale left unpadded fails the same check, so the check
    does look at the layouts."""
    num_experts, n, k = 4, 160, 96
    rows = sum([0, 32, 96, 160]) + TRAILING_ROWS
    with FakeTensorMode():
        offsets = torch.empty(num_experts, dtype=torch.int32)
        cuda_offsets = torch.empty(num_experts, dtype=torch.int32, device="cuda")
        codes = {name: torch.empty(*shape, dtype=torch.uint8) for name, shape in {
            "x": (rows, k // 32), "w": (num_experts, n, k // 32), "grad": (rows, n // 32),
            "w_t": (num_experts, k, n // 32), "grad_t": (n, rows // 32), "x_t": (k, rows // 32)}.items()}
        x_scales = on_fake_cuda(to_blocked_m_groups(codes["x"], offsets))
        w_scales = on_fake_cuda(to_blocked_per_expert(codes["w"]))  # W in blocks along K
        out = torch._scaled_grouped_mm(fake_e4m3(rows, k), fake_e4m3(num_experts, k, n, column_major=True),
                                       x_scales, w_scales, offs=cuda_offsets, out_dtype=torch.bfloat16)
        assert out.shape == (rows, n)

        grad_scales = on_fake_cuda(to_blocked_m_groups(codes["grad"], offsets))
        w_t_scales = on_fake_cuda(to_blocked_per_expert(codes["w_t"]))  # W in blocks along N
        grad_input = torch._scaled_grouped_mm(fake_e4m3(rows, n), fake_e4m3(num_experts, n, k, column_major=True),
                                              grad_scales, w_t_scales, offs=cuda_offsets, out_dtype=torch.bfloat16)
        assert grad_input.shape == (rows, k)

        grad_t_scales = on_fake_cuda(to_blocked_k_groups(codes["grad_t"], offsets))
        x_t_scales = on_fake_cuda(to_blocked_k_groups(codes["x_t"], offsets))
        grad_weight = torch._scaled_grouped_mm(fake_e4m3(n, rows), fake_e4m3(rows, k, column_major=True),
                                               grad_t_scales, x_t_scales, offs=cuda_offsets, out_dtype=torch.bfloat16)
        assert grad_weight.shape == (num_experts, n, k)

        unpadded = torch.empty(num_experts, n * k // 32, dtype=torch.float8_e8m0fnu, device="cuda")
        with pytest.raises(RuntimeError, match="For MXFP8, expected"):
            torch._scaled_grouped_mm(fake_e4m3(rows, k), fake_e4m3(num_experts, k, n, column_major=True),
                                     x_scales, unpadded, offs=cuda_offsets, out_dtype=torch.bfloat16)
