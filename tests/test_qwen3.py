"""Qwen3's own model (titan/models/qwen3): its flavors against the published parameter counts (total, without the
embedding, and a mixture of experts' active ones), the tied flavors' one matrix, and an init that fills every
parameter. (Its mixture of experts: tests/test_moe.py; against transformers: tests/test_hf_qwen3.py; parallel
layouts: tests/test_parallel.py.)"""

import dataclasses

import pytest
import torch

from titan.models.common.flops import num_active_params, num_params
from titan.models.qwen3 import QWEN3_FLAVORS, Transformer, init_weights

# Published sizes (the Qwen3 technical report, arXiv:2505.09388, and each model card): total, non-embedding (the
# embedding and, untied, the output left out) and, for MoE, activated parameters, in billions as printed.
PUBLISHED = {
    "0.6B": (0.6, 0.44, None), "1.7B": (1.7, 1.4, None), "4B": (4.0, 3.6, None), "8B": (8.2, 6.95, None),
    "14B": (14.8, 13.2, None), "32B": (32.8, 31.2, None), "30B-A3B": (30.5, 29.9, 3.3),
    "235B-A22B": (235, 234, 22),
}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_parameter_counts_match_the_published_ones(flavor: str) -> None:
    args = QWEN3_FLAVORS[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    total = num_params(model, exclude_embedding=False)
    vocab_rows = model.tok_embeddings.weight.numel() * (1 if args.tie_embeddings else 2)
    published_total, published_non_embedding, published_active = PUBLISHED[flavor]

    def matches(count: int, published: float) -> bool:
        # Printed to the last digit shown (0.44B, 6.95B, 235B), rounded or cut off (3.35B active is "3.3B"): at
        # most half a unit of that digit below, and less than one above.
        digits = str(published).split(".")
        unit = 10 ** -len(digits[1]) if len(digits) > 1 else 1
        return published - unit / 2 <= count / 1e9 < published + unit

    assert matches(total, published_total)
    assert matches(total - vocab_rows, published_non_embedding)
    if published_active is not None:
        active = num_active_params(model, args.moe, args.tie_embeddings, exclude_embedding=False)
        assert matches(active, published_active)


def test_tied_flavors_share_one_matrix() -> None:
    with torch.device("meta"):
        tied, untied = Transformer(QWEN3_FLAVORS["0.6B"]), Transformer(QWEN3_FLAVORS["8B"])
    assert tied.output.weight is tied.tok_embeddings.weight
    assert untied.output.weight is not untied.tok_embeddings.weight


def test_a_flavor_initialises_every_parameter() -> None:
    args = dataclasses.replace(QWEN3_FLAVORS["debugmodel_moe"], vocab_size=2256, max_seq_len=32, n_layers=2)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    for param in model.parameters():
        param.data.fill_(float("nan"))
    init_weights(model, "cpu")
    assert all(param.isfinite().all() for param in model.parameters())
    tokens = torch.randint(0, 2256, (2, 16))
    assert model(tokens, labels=tokens).isfinite()
