"""Block-causal attention over packed documents: the packed batch computes what each document computes on its own."""

import pytest
import torch

from titan.config.check import load_job_config
from titan.config.errors import ConfigError
from titan.models.llama import ModelArgs, Transformer, init_weights
from titan.models.llama.attention import build_block_mask, build_dense_mask, document_layout
from titan.models.llama.loss import IGNORE_INDEX, mask_cross_document_targets

VOCAB, EOS = 2256, 2255
SEQ = 24
# Where documents start (right after an EOS) in each packed row of SEQ tokens, and what the row shows.
LAYOUTS = {
    "one document": [0],
    "two documents": [0, 9],
    "many documents": [0, 3, 4, 11, 12, 20, 23],
    "a document longer than the sequence": [],  # the window starts and ends inside one document
    "documents cut by both ends": [7, 15],  # the first starts before the window, the last ends after it
}


def build(backend: str) -> Transformer:
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=SEQ,
                     attn_backend=backend)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    init_weights(model)
    return model


def packed_row(starts: list[int]) -> torch.Tensor:
    torch.manual_seed(len(starts))
    tokens = torch.randint(0, EOS, (1, SEQ))
    tokens[0, [start - 1 for start in starts if start > 0]] = EOS
    return tokens


def documents(starts: list[int]) -> list[slice]:
    """The row's documents as slices: a document starts after each EOS and at the row's first token."""
    bounds = sorted({0, *starts, SEQ})
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def test_layout_restarts_positions_after_every_eos() -> None:
    tokens = packed_row(LAYOUTS["documents cut by both ends"])
    positions, document_ids = document_layout(tokens, EOS)
    assert positions[0].tolist() == [*range(7), *range(8), *range(9)]
    assert document_ids[0].tolist() == [0] * 7 + [1] * 8 + [2] * 9


def test_next_document_start_is_no_target_but_the_eos_is() -> None:
    inputs = torch.tensor([[4, EOS, 6, EOS]])
    labels = torch.tensor([[EOS, 6, EOS, 8]])
    assert mask_cross_document_targets(inputs, labels, EOS).tolist() == [[EOS, IGNORE_INDEX, EOS, IGNORE_INDEX]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_causal_equals_each_document_alone(layout: str) -> None:
    """Logits and every parameter's gradient of the packed row (SDPA with the dense block-causal mask) equal those
    of running each document on its own (causal, positions from 0), within fp32 tolerance."""
    model, starts = build("sdpa"), LAYOUTS[layout]
    tokens = packed_row(starts)
    weights = torch.randn(1, SEQ, model.output.out_features)  # a loss that reaches every logit

    model.zero_grad()
    packed = model(tokens, *document_layout(tokens, EOS))
    (packed * weights).sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}

    model.zero_grad()
    alone = []
    for document in documents(starts):
        logits = model(tokens[:, document])  # positions 0 .. len - 1, causal
        (logits * weights[:, document]).sum().backward()
        alone.append(logits.detach())
    torch.testing.assert_close(packed.detach(), torch.cat(alone, dim=1), rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        # Sums over tokens in another order: fp32 roundings relative to the gradient's own scale.
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-5, atol=1e-5 * p.grad.abs().max().item(),
                                   msg=name)


@pytest.mark.parametrize("layout", ["two documents", "many documents", "documents cut by both ends"])
def test_flex_block_mask_equals_dense_mask(layout: str) -> None:
    """FlexAttention's BlockMask keeps the same keys as SDPA's dense mask (forward only: torch has no FlexAttention
    backward on CPU), and a flex model computes the same logits."""
    tokens = torch.cat([packed_row(LAYOUTS[layout]), packed_row(LAYOUTS["many documents"])])
    _, document_ids = document_layout(tokens, EOS)
    block_mask = build_block_mask(document_ids, SEQ, tokens.device)
    dense = torch.stack([block_mask.mask_mod(torch.tensor(b), None, torch.arange(SEQ)[:, None],
                                             torch.arange(SEQ)[None, :]) for b in range(2)])
    assert torch.equal(dense[:, None], build_dense_mask(document_ids))
    flex, sdpa = build("flex"), build("sdpa")
    with torch.no_grad():
        torch.testing.assert_close(flex(tokens, *document_layout(tokens, EOS)),
                                   sdpa(tokens, *document_layout(tokens, EOS)), rtol=1e-5, atol=1e-5)


def test_compiled_flex_blocks_match_sdpa() -> None:
    """FlexAttention inside compiled blocks, as --training.compile runs it (forward: CPU has no backward)."""
    tokens = torch.cat([packed_row(LAYOUTS["many documents"]), packed_row(LAYOUTS["two documents"])])
    flex, sdpa = build("flex"), build("sdpa")
    for block in flex.layers.values():
        block.compile(fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(flex(tokens, *document_layout(tokens, EOS)),
                                   sdpa(tokens, *document_layout(tokens, EOS)), rtol=1e-5, atol=1e-5)


def test_flex_backend_on_cpu_is_a_config_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU, where FlexAttention trains")
    with pytest.raises(ConfigError, match="--model.attn_backend flex needs a CUDA GPU"):
        load_job_config(["--model.attn_backend", "flex"], world_size=1)
