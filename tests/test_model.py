"""What the model families share (titan/models/common), on the Llama model: the padded vocabulary, RoPE (eager and
compiled, Llama 3.1 scaling) and GQA against references, causality, the loss, parameter counts without the embedding,
RMSNorm's rounding. (Each family's own model: tests/test_llama.py, tests/test_qwen3.py, tests/test_deepseek_v3.py;
that models import nothing from the parallel stages: tests/test_imports.py.)"""

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from titan.models.common.args import padded_vocab_size
from titan.models.common.attention import Attention, SDPAAttention, expand_kv_heads
from titan.models.common.flops import num_params
from titan.models.common.loss import cross_entropy_loss
from titan.models.common.norms import RMSNorm
from titan.models.common.rotary import (
    RopeScaling,
    apply_rotary_emb,
    precompute_rope_cache,
    real_rotation,
    scale_rope_frequencies,
)
from titan.models.llama import ModelArgs, Transformer
from titan.models.llama.args import LLAMA31_ROPE_SCALING

from harness.models import build_model
from reference.rope_ref import complex_rope, complex_rotation_table

VOCAB = 2256  # the shipped tokenizer's odd size
SMALL = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=64)


def test_logits_cover_padded_vocab() -> None:
    model = build_model(SMALL)
    tokens = torch.randint(0, VOCAB, (2, 16))
    assert padded_vocab_size(VOCAB, 64) == 2304
    assert padded_vocab_size(2304, 64) == 2304
    assert model(tokens).shape == (2, 16, 2304)
    assert model.user_logits(tokens).shape == (2, 16, VOCAB)
    assert model.tok_embeddings.weight.shape == model.output.weight.shape == (2304, 64)


def rotate_reference(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE from the paper: channels (2i, 2i+1) at position m rotate by m * theta^(-2i/head_dim)."""
    bs, seq, heads, head_dim = x.shape
    out = torch.empty_like(x, dtype=torch.float64)
    x = x.double()
    for m in range(seq):
        for i in range(head_dim // 2):
            angle = m * theta ** (-2 * i / head_dim)
            a, b = x[:, m, :, 2 * i], x[:, m, :, 2 * i + 1]
            out[:, m, :, 2 * i] = a * math.cos(angle) - b * math.sin(angle)
            out[:, m, :, 2 * i + 1] = a * math.sin(angle) + b * math.cos(angle)
    return out


def test_rope_matches_rotation_reference() -> None:
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, rope_theta=10000.0, max_seq_len=16)
    x = torch.randn(2, 12, 3, 16)
    got = apply_rotary_emb(x, precompute_rope_cache(args))
    torch.testing.assert_close(got.double(), rotate_reference(x, 10000.0), rtol=1e-5, atol=1e-5)


def compiled_rotation(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """apply_rotary_emb as a compiled block runs it: the real tables (inductor has no complex codegen)."""
    return real_rotation(x, rope_cache[None, :x.size(1)])


@pytest.mark.parametrize("rotate", [apply_rotary_emb, compiled_rotation], ids=["eager_complex", "compiled_real"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_complex_reference(rotate: Callable, dtype: torch.dtype) -> None:
    """Eager RoPE (a complex product) and compiled RoPE (the product written out in reals) are Meta's complex
    product: the same fp32 products and sums, so equal up to the rounding order inside complex multiplication (a few
    fp32 ulps; at most 1 bf16 ulp after the cast back), with and without Llama 3.1 frequency scaling."""
    for scaling in (None, LLAMA31_ROPE_SCALING):
        args = ModelArgs(dim=256, n_layers=1, n_heads=2, n_kv_heads=2, rope_scaling=scaling, max_seq_len=64)
        freqs = 1.0 / (args.rope_theta ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
        if scaling is not None:
            freqs = scale_rope_frequencies(freqs, scaling)
        table = complex_rotation_table(128, 64, args.rope_theta, freqs)
        torch.manual_seed(0)
        x = (4 * torch.randn(2, 48, 3, 128)).to(dtype)
        got, want = rotate(x, precompute_rope_cache(args)), complex_rope(x, table)
        assert got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            # One bf16 ulp at the value's magnitude: 2^-7 relative.
            assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-30).all()


class KernelCount(TorchDispatchMode):
    """Counts the aten ops that launch a kernel on a GPU: every op but views and shape queries."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature, untyped
        if not func.is_view and func._overloadpacket not in (torch.ops.aten.sym_size, torch.ops.aten.sym_stride):
            self.ops.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_eager_rope_launches_three_kernels_for_bf16() -> None:
    """The eager rotation of a bf16 q or k: upcast, one complex multiply, downcast (the real tables took nine,
    four of them on stride-2 halves), whether the rows are shared or gathered per sample (block-causal)."""
    args = ModelArgs(dim=256, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=64)
    x = torch.randn(2, 48, 2, 128, dtype=torch.bfloat16)
    table = precompute_rope_cache(args)
    for rows in (table, table[torch.randint(0, 64, (2, 48))]):
        with KernelCount() as counted:
            apply_rotary_emb(x, rows)
        assert counted.ops == ["_to_copy", "mul", "_to_copy"], counted.ops


def scale_reference(freq: float, s: RopeScaling) -> float:
    """Llama 3.1 `apply_scaling`, one frequency at a time."""
    wavelen = 2 * math.pi / freq
    if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
        return freq
    if wavelen > s.original_max_position_embeddings / s.low_freq_factor:
        return freq / s.factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor
                                                                                   - s.low_freq_factor)
    return (1 - smooth) * freq / s.factor + smooth * freq


def test_rope_scaling_matches_llama31_formula() -> None:
    head_dim = 128
    freqs = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    got = scale_rope_frequencies(freqs, LLAMA31_ROPE_SCALING)
    want = torch.tensor([scale_reference(f, LLAMA31_ROPE_SCALING) for f in freqs.tolist()], dtype=torch.float64)
    torch.testing.assert_close(got, want)
    # All three regimes occur at head_dim 128, so each branch was checked.
    assert (got == freqs).any() and (got == freqs / 8).any() and ((got != freqs) & (got != freqs / 8)).any()


def test_scaled_table_uses_scaled_frequencies() -> None:
    args = ModelArgs(dim=256, n_layers=1, n_heads=2, n_kv_heads=2, rope_scaling=LLAMA31_ROPE_SCALING,
                     max_seq_len=4)
    freqs = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    cos, sin = precompute_rope_cache(args)[1].unbind(-1)  # position 1: the angle is the frequency
    torch.testing.assert_close(torch.atan2(sin, cos), scale_rope_frequencies(freqs, LLAMA31_ROPE_SCALING))


def test_gqa_equals_mha_with_repeated_kv_weights() -> None:
    torch.manual_seed(0)
    gqa_args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=16)
    gqa, mha = Attention(gqa_args), Attention(dataclasses.replace(gqa_args, n_kv_heads=4))
    head_dim = 16
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for name in ("wk", "wv"):
            kv = getattr(gqa, name).weight.view(2, head_dim, 64)  # (kv_heads, head_dim, dim)
            getattr(mha, name).weight.copy_(kv.repeat_interleave(2, dim=0).reshape(4 * head_dim, 64))
    x = torch.randn(2, 10, 64)
    rope_cache = precompute_rope_cache(gqa_args)
    torch.testing.assert_close(gqa(x, rope_cache, None), mha(x, rope_cache, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_reads_kv_heads_in_place_as_expanded_copies_would(dtype: torch.dtype) -> None:
    """enable_gqa (no copies) gives the attention of kv heads expanded to every query head (main's copies), and the
    expansion gives query head h kv head h // n_rep, as repeat_interleave does."""
    torch.manual_seed(0)
    q = torch.randn(2, 8, 32, 16, dtype=dtype)  # (bs, heads, seq, head_dim)
    k, v = torch.randn(2, 2, 32, 16, dtype=dtype), torch.randn(2, 2, 32, 16, dtype=dtype)  # 2 kv heads: n_rep 4
    assert torch.equal(expand_kv_heads(k, 4), k.repeat_interleave(4, dim=1))
    expanded = F.scaled_dot_product_attention(q, expand_kv_heads(k, 4), expand_kv_heads(v, 4), is_causal=True)
    torch.testing.assert_close(SDPAAttention()(q, k, v, None), expanded)


def test_future_tokens_do_not_change_earlier_logits() -> None:
    model = build_model(SMALL)
    tokens = torch.randint(0, VOCAB, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (tokens[0, 8:] + 1) % VOCAB
    torch.testing.assert_close(model(changed)[:, :8], model(tokens)[:, :8])
    assert not torch.allclose(model(changed)[:, 8:], model(tokens)[:, 8:])


def test_loss_ignores_padded_columns() -> None:
    logits = torch.randn(2, 5, 2304)
    labels = torch.randint(0, VOCAB, (2, 5))
    loss = cross_entropy_loss(logits, labels, VOCAB)
    torch.testing.assert_close(loss, F.cross_entropy(logits[..., :VOCAB].reshape(10, VOCAB), labels.reshape(10)))
    logits[..., VOCAB:] = 1e9
    torch.testing.assert_close(cross_entropy_loss(logits, labels, VOCAB), loss)


def test_loss_is_fp32_for_bf16_logits() -> None:
    logits = torch.randn(2, 5, 2304).bfloat16()
    labels = torch.randint(0, VOCAB, (2, 5))
    assert cross_entropy_loss(logits, labels, VOCAB).dtype == torch.float32


def test_num_params_excludes_only_embedding() -> None:
    with torch.device("meta"):
        model = Transformer(SMALL)
    total = sum(p.numel() for p in model.parameters())
    assert num_params(model, exclude_embedding=False) == total
    assert num_params(model, exclude_embedding=True) == total - 2304 * 64


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float64: x * rsqrt(mean(x^2) + eps) * weight, unrounded."""
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize(("x_dtype", "weight_dtype"), [(torch.bfloat16, torch.bfloat16),
                                                      (torch.float32, torch.float32),
                                                      (torch.bfloat16, torch.float32)],
                         ids=["bf16_under_fsdp", "fp32", "bf16_under_autocast"])
def test_rms_norm_accumulates_in_fp32_and_rounds_once(x_dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    """Under FSDP's bf16 parameters the norm is one F.rms_norm call: fp32 inside and the output rounded once, so it
    is the float64 result correctly rounded (but where fp32's own error meets a rounding tie: 1 in 32,768 here),
    where normalising and scaling apart rounded twice (a quarter of the values off). It stays within one bf16
    rounding of that two-step norm, and autocast's fp32 weight keeps the two-step form."""
    torch.manual_seed(0)
    norm = RMSNorm(512, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(512))
    norm = norm.to(weight_dtype)
    x = (3 * torch.randn(64, 512)).to(x_dtype)
    got = norm(x)
    want = rms_norm_reference(x, norm.weight, 1e-6)
    two_step = F.rms_norm(x.float(), (512,), eps=1e-6).type_as(x) * norm.weight
    if x_dtype == weight_dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-6)
    elif weight_dtype == torch.bfloat16:
        assert got.dtype == torch.bfloat16
        rounded = want.to(torch.bfloat16)
        assert (got != rounded).float().mean() < 1e-3
        assert (two_step != rounded).float().mean() > 0.1  # the case tells one rounding from two
        torch.testing.assert_close(got.float(), two_step.float(), rtol=2**-7, atol=1e-6)
    else:
        assert torch.equal(got, two_step)
