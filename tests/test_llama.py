"""Llama 3's own model (titan/models/llama): its flavors' FFN sizes and published parameter counts, its init's
standard deviations, with and without depth scaling, and its FLOPs per token. (What every family shares, RoPE, GQA,
the loss and RMSNorm: tests/test_model.py; against transformers: tests/test_hf_llama.py; parallel layouts:
tests/test_parallel.py.)"""

import dataclasses

import pytest
import torch

from titan.models.common.flops import num_params
from titan.models.common.rotary import precompute_rope_cache
from titan.models.llama import LLAMA3_FLAVORS, ModelArgs, Transformer, ffn_hidden_dim, flops_per_token

from harness.models import build_model

VOCAB = 2256  # the shipped tokenizer's odd size
SMALL = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=64)


@pytest.mark.parametrize(
    ("flavor", "hidden"), [("debugmodel", 768), ("1B", 8192), ("3B", 8192), ("8B", 14336), ("70B", 28672),
                           ("405B", 53248)]
)
def test_ffn_hidden_dim(flavor: str, hidden: int) -> None:
    assert ffn_hidden_dim(LLAMA3_FLAVORS[flavor]) == hidden


# Published counts with Llama 3's 128256 vocab (a multiple of 64, so no padding). 1B and 3B are
# published tied; Titan keeps a separate output matrix, so compare without it.
@pytest.mark.parametrize(
    ("flavor", "published", "tied"),
    [("1B", 1_235_814_400, True), ("3B", 3_212_749_824, True), ("8B", 8_030_261_248, False),
     ("70B", 70_553_706_496, False), ("405B", 405_853_388_800, False)],
)
def test_flavor_parameter_counts(flavor: str, published: int, tied: bool) -> None:
    with torch.device("meta"):
        model = Transformer(LLAMA3_FLAVORS[flavor])
    total = num_params(model, exclude_embedding=False)
    if tied:
        total -= model.output.weight.numel()
    assert total == published


def test_debugmodel_parameter_count() -> None:
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=VOCAB))
    assert num_params(model, exclude_embedding=False) == 5_901_568
    assert num_params(model, exclude_embedding=True) == 5_901_568 - 2304 * 256


def test_meta_build_and_init_is_deterministic() -> None:
    first, second = build_model(SMALL, seed=7), build_model(SMALL, seed=7)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(first.rope.cache, precompute_rope_cache(SMALL))
    assert not torch.equal(build_model(SMALL, seed=8).output.weight, first.output.weight)


def test_init_stds() -> None:
    args = ModelArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=VOCAB)
    model = build_model(args)
    block0, block3 = model.layers["0"], model.layers["3"]
    assert model.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.02)
    assert block0.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block0.feed_forward.w1.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block0.attention.wo.weight.std().item() == pytest.approx(0.02 / 2**0.5, rel=0.05)
    assert block3.feed_forward.w2.weight.std().item() == pytest.approx(0.02 / 8**0.5, rel=0.05)
    # Truncation at 3 std trims the std to about 0.986 of dim**-0.5.
    out = model.output.weight
    assert out.std().item() == pytest.approx(0.986 / 16, rel=0.03)
    assert out.abs().max().item() <= 3 / 16
    assert torch.equal(block3.ffn_norm.weight, torch.ones(256)) and torch.equal(model.norm.weight, torch.ones(256))


def test_init_without_depth_scaling() -> None:
    args = ModelArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=VOCAB, depth_init=False)
    model = build_model(args)
    for block in model.layers.values():
        assert block.attention.wo.weight.std().item() == pytest.approx(0.02 / 8**0.5, rel=0.05)


def test_flops_per_token_small_case() -> None:
    # 1000 matmul params, 2 layers of dim 8, seq 16: 6*1000 + 12*2*8*16 = 6000 + 3072.
    args = ModelArgs(dim=8, n_layers=2, n_heads=2, n_kv_heads=2)
    assert flops_per_token(args, num_params=1000, seq_len=16) == 9072
