"""GPT-OSS's own model (titan/models/gpt_oss): its flavors against the published totals and active parameters, a
debug flavor that keeps every part, the decoder's one mask per distinct window and one rotary table per distinct
spec, each block reading its own, packed documents that compute what each computes alone through windows and sinks,
the FLOPs of windowed blocks, the biased experts' grouped matmuls against the loop over experts, and an init that
fills every parameter. (Against transformers: tests/test_hf_gpt_oss.py; parallel layouts: tests/test_parallel.py.)"""

import dataclasses

import pytest
import torch

from titan.data.micro_batch import document_layout
from titan.models.common import moe as moe_module
from titan.models.common.flops import num_params
from titan.models.common.moe import READ_COUNTS, HighPrecisionMatmuls
from titan.models.families import FAMILIES
from titan.models.gpt_oss import GPT_OSS_FLAVORS, Transformer, flops_per_token, init_weights
from titan.models.gpt_oss.experts import ClampedSwiGLU

from harness.models import build_for_comparison

GPT_OSS = FAMILIES["gpt_oss"]
VOCAB, EOS = 2256, 2255
# OpenAI's model card (gpt-oss-120b & gpt-oss-20b, table 1): total and active parameters per token, in billions as
# printed; active counts the unembedding, not the embedding.
PUBLISHED = {"20B": (20.91, 3.61), "120B": (116.83, 5.13)}
DEBUG = dataclasses.replace(GPT_OSS_FLAVORS["debugmodel"], vocab_size=VOCAB, max_seq_len=64, sliding_window=6)


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_parameter_counts_match_the_published_ones(flavor: str) -> None:
    args = GPT_OSS_FLAVORS[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    total, active = PUBLISHED[flavor]
    assert round(num_params(model, exclude_embedding=False) / 1e9, 2) == total
    assert round(GPT_OSS.num_active_params(args, model) / 1e9, 2) == active


def test_the_debug_flavor_keeps_every_part() -> None:
    """Alternating windows (the first block sliding), sinks and biases in every block, biased experts computing the
    clamped SwiGLU, a biased router choosing 4 experts by its logits, one rotary table (YaRN, not truncated)."""
    args = GPT_OSS_FLAVORS["debugmodel"]
    specs = args.attention_specs()
    assert [spec.window for spec in specs] == [16, None, 16, None]
    assert all(spec.sinks and spec.bias for spec in specs) and len({spec.rope for spec in specs}) == 1
    assert args.rope_scaling.truncate is False
    moe = args.moe
    assert (moe.top_k, moe.score_func, moe.router_bias, moe.expert_linear_bias) == (4, "topk_softmax", True, True)
    assert isinstance(moe.expert_function, ClampedSwiGLU)
    with torch.device("meta"):
        model = Transformer(args)
    names = dict(model.named_parameters())
    for name in ("attention.sinks", "attention.wq.bias", "attention.wo.bias", "moe.router.gate.bias",
                 "moe.experts.w1_bias", "moe.experts.w2_bias", "moe.experts.w3_bias"):
        assert f"layers.1.{name}" in names, name


def test_the_decoder_builds_one_mask_per_window_and_one_table_per_rope() -> None:
    """Two windows (sliding and full) give two masks, built once per forward and handed to the blocks of each; one
    RopeSpec gives one table. A block reads its own: the sliding blocks' mask keeps the window's keys only."""
    model = build_for_comparison(DEBUG, seed=0)
    assert model.attention_mask.windows == [6, None] and len(model.rope.specs) == 1
    tokens = torch.randint(0, EOS, (1, 16), generator=torch.Generator().manual_seed(0))
    seen = {}

    def keep_mask(layer_id: str) -> object:
        def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            seen[layer_id] = inputs[3]
        return hook
    for layer_id, block in model.layers.items():
        block.attention.inner_attention.register_forward_hook(keep_mask(layer_id))
    with torch.no_grad():
        model(tokens)
    query, key = torch.arange(16)[:, None], torch.arange(16)[None, :]
    assert torch.equal(seen["0"][0, 0], (key <= query) & (key > query - 6)) and seen["0"] is seen["2"]
    assert seen["1"] is None and seen["3"] is None  # causal SDPA, no mask


def test_packed_documents_compute_what_each_document_computes_alone() -> None:
    """Block-causal attention through sliding windows and sinks: the logits of a packed row equal those of each of
    its documents on its own, including a document longer than the window."""
    model = build_for_comparison(DEBUG, seed=1)
    tokens = torch.randint(0, EOS, (1, 40), generator=torch.Generator().manual_seed(1))
    tokens[0, [4, 30]] = EOS
    with torch.no_grad():
        packed = model(tokens, *document_layout(tokens == EOS))
        alone = torch.cat([model(tokens[:, start:end]) for start, end in ((0, 5), (5, 31), (31, 40))], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_windowed_blocks_count_the_flops_of_their_window() -> None:
    """Llama's convention per block: 12 x heads x head_dim x the keys a query reads, the window in a sliding block."""
    args = GPT_OSS_FLAVORS["20B"]
    attention = 12 * args.n_heads * args.head_dim
    assert flops_per_token(args, 0, 8192) == attention * 12 * (8192 + 128)
    assert flops_per_token(args, 0, 64) == attention * 24 * 64


def test_biased_experts_grouped_matmuls_match_the_loop_over_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The clamped SwiGLU over biased experts, torch._grouped_mm with each row's expert's bias against one matmul per
    expert: outputs and every gradient, empty experts included."""
    generator = torch.Generator().manual_seed(2)
    counts = torch.tensor([5, 0, 3, 9])
    params = {"w1": torch.randn(4, 12, 8, generator=generator), "w2": torch.randn(4, 8, 12, generator=generator),
              "w3": torch.randn(4, 12, 8, generator=generator), "w1_bias": torch.randn(4, 12, generator=generator),
              "w2_bias": torch.randn(4, 8, generator=generator), "w3_bias": torch.randn(4, 12, generator=generator)}
    x = torch.randn(17, 8, generator=generator) * 3  # wide enough that the clamps bite
    upstream = torch.randn(17, 8, generator=generator)

    def run() -> list[torch.Tensor]:
        leaves = {name: value.clone().requires_grad_() for name, value in params.items()}
        inputs = x.clone().requires_grad_()
        out = HighPrecisionMatmuls()(inputs, counts, leaves, ClampedSwiGLU(), READ_COUNTS)
        (out * upstream).sum().backward()
        return [out.detach(), inputs.grad, *(leaves[name].grad for name in params)]

    assert moe_module.grouped_mm_supported(x)
    grouped = run()
    monkeypatch.setattr(moe_module, "grouped_mm_supported", lambda x, token_counts=READ_COUNTS: False)
    for got, want in zip(grouped, run()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_init_fills_every_parameter() -> None:
    """Every parameter filled (biases at 0, sinks drawn), the same from the same seed."""
    with torch.device("meta"):
        model = Transformer(DEBUG)
    model.to_empty(device="cpu")
    for param in model.parameters():
        param.data.fill_(float("nan"))
    torch.manual_seed(0)
    init_weights(model, "cpu")
    for name, param in model.named_parameters():
        assert param.isfinite().all(), name
        if name.endswith("bias"):
            assert not param.any(), name
    assert model.layers["0"].attention.sinks.std() > 0


@pytest.mark.parametrize("converter", ["float8", "mx", "nvfp4"])
def test_converters_take_the_published_shapes(converter: str) -> None:
    """A width of 2,880 is a multiple of 16 and of 32 (not of 128): float8 and MX convert every attention linear and
    every block's experts of the 20B flavor, NVFP4 the attention's but its last blocks'; none skips a layer for its
    shape, the routers and the output stay in high precision; and the debug model, converted, trains a step."""
    from titan.config.job import MX, NVFP4, Float8
    from titan.quant.convert import apply_converters

    def convert(model: torch.nn.Module) -> list:
        return apply_converters(model, [converter], Float8(emulate=True), MX(emulate=True), NVFP4(emulate=True),
                                tp_degree=1, fsdp_enabled=False, print_after_conversion=False).decisions

    with torch.device("meta"):
        decisions = convert(Transformer(GPT_OSS_FLAVORS["20B"]))
    by_kind = {kind: [d for d in decisions if kind in d.fqn] for kind in ("attention", "experts", "router", "output")}
    assert not any(d.converted for d in by_kind["router"] + by_kind["output"])
    assert not any("divisible" in d.result or "multiple" in d.result for d in decisions)
    converted_attention = sum(d.converted for d in by_kind["attention"])
    assert converted_attention == (96 if converter != "nvfp4" else 80)
    assert all(d.converted for d in by_kind["experts"]) == (converter != "nvfp4")
    model = build_for_comparison(DEBUG, seed=4).train()
    convert(model)
    tokens = torch.randint(0, EOS, (2, 32), generator=torch.Generator().manual_seed(4))
    loss = model(tokens, labels=torch.roll(tokens, -1, dims=1))
    loss.backward()
    assert loss.isfinite() and all(param.grad.isfinite().all() for param in model.parameters())
