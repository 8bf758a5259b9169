"""DeepSeek-V3's own pieces: group-limited sigmoid routing against a hand computation, latent attention under
block-causal masking against each document on its own, multi-token prediction's targets and its place in the loss
and gradient, the flavors' sizes against the published ones, and the layouts it rejects. (Logits and gradients
against transformers: tests/test_hf_deepseek_v3.py; parallel layouts: tests/test_parallel.py.)"""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from titan.config.errors import ConfigError
from titan.data.micro_batch import document_layout
from titan.models.common.attention import build_dense_mask
from titan.models.common.flops import num_active_params, num_params
from titan.models.common.loss import IGNORE_INDEX
from titan.models.common.moe import MoEArgs, Router
from titan.models.common.mtp import future_labels
from titan.models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, Transformer, init_weights
from titan.validate import load_job_config

VOCAB = 2256
# 8 experts in 4 groups of 2; a token may use 2 groups and 3 experts; weights normalised, then times 2.5.
GROUPED = MoEArgs(num_experts=8, top_k=3, hidden_dim=16, score_func="sigmoid", n_group=4, topk_group=2,
                  routed_scaling_factor=2.5, expert_bias=True)


def route(scores: list[float], bias: list[float] | None = None,
          moe: MoEArgs = GROUPED) -> tuple[list[int], torch.Tensor]:
    """The router's experts (ascending) and weights (in that order) for one token whose sigmoid scores are `scores`:
    the gate's logits are their logits, through an identity gate."""
    router = Router(8, moe)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(8))
        router.expert_bias.copy_(torch.tensor(bias or [0.0] * 8))
    logits = torch.logit(torch.tensor([scores], dtype=torch.float64)).float()
    weights, experts, _ = router(logits)
    order = experts[0].argsort()
    return experts[0][order].tolist(), weights[0][order]


def expected_weights(scores: list[float], chosen: list[int]) -> torch.Tensor:
    picked = torch.tensor([scores[e] for e in chosen])
    return picked / picked.sum() * 2.5


def test_group_limited_routing_matches_a_hand_computation() -> None:
    # Groups (0,1) (2,3) (4,5) (6,7) score by their two best: 0.9+0.1=1.0, 0.6+0.5=1.1, 0.95+0.0=0.95, 0.3+0.3=0.6.
    # The best expert (4, 0.95) is in the third-best group, so it is out; groups 1 and 0 are in. Their best three are
    # 0 (0.9), 2 (0.6), 3 (0.5): group 0 gives one expert, group 1 two.
    scores = [0.9, 0.1, 0.6, 0.5, 0.95, 0.01, 0.3, 0.3]
    chosen, weights = route(scores)
    assert chosen == [0, 2, 3]
    torch.testing.assert_close(weights, expected_weights(scores, chosen))


def test_a_chosen_group_may_give_no_expert() -> None:
    # 3 of the 4 groups allowed, 2 experts: groups score 1.0, 1.0, 0.6, 0.1, so groups 0, 1 and 2 are in, and the
    # best two experts (0 at 0.9, 2 at 0.8) leave group 2 empty.
    scores = [0.9, 0.1, 0.8, 0.2, 0.3, 0.3, 0.05, 0.05]
    chosen, weights = route(scores, moe=dataclasses.replace(GROUPED, topk_group=3, top_k=2))
    assert chosen == [0, 2]
    torch.testing.assert_close(weights, expected_weights(scores, chosen))


def test_the_bias_breaks_ties_and_picks_groups_but_weights_read_the_scores() -> None:
    # Groups score 1.0 (0.5 + 0.5), 1.6 (0.8 + 0.8), 0.2, 0.2: experts 2 and 3, then one of group 0's tied pair, which
    # a bias of 0.01 on expert 1 decides; its weight reads its score, 0.5, not the biased 0.51.
    scores = [0.5, 0.5, 0.8, 0.8, 0.1, 0.1, 0.1, 0.1]
    chosen, weights = route(scores, bias=[0.0, 0.01, 0, 0, 0, 0, 0, 0])
    assert chosen == [1, 2, 3]
    torch.testing.assert_close(weights, expected_weights(scores, chosen))
    # A bias of 0.2 on group 3's experts lifts it (0.65 + 0.65) over group 1 (0.45 + 0.45) into second place.
    scores = [0.85, 0.85, 0.45, 0.45, 0.05, 0.05, 0.45, 0.45]
    chosen, _ = route(scores, bias=[0, 0, 0, 0, 0, 0, 0.2, 0.2])
    assert chosen[:2] == [0, 1] and chosen[2] in (6, 7)


def test_tied_groups_are_both_taken_and_tied_experts_share_the_weight() -> None:
    # Groups 0 and 2 tie at 1.2, group 1 at 1.2 too: three-way tie for two places. Whatever the tie order, the chosen
    # experts come from two of the tied groups, and every chosen expert scores 0.6 (equal weights 2.5 / 3).
    scores = [0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.2, 0.2]
    chosen, weights = route(scores)
    assert len({e // 2 for e in chosen}) <= 2 and all(e < 6 for e in chosen)
    torch.testing.assert_close(weights, torch.full((3,), 2.5 / 3))


def test_latent_attention_keeps_documents_apart() -> None:
    """Block-causal attention over a packed row equals each document run on its own, positions restarting."""
    args = dataclasses.replace(DEEPSEEK_V3_FLAVORS["debugmodel"], vocab_size=VOCAB, max_seq_len=64, n_layers=2)
    torch.manual_seed(0)
    model = Transformer(args)
    init_weights(model)
    block = model.layers["0"].attention  # the dense block's latent attention
    eos = 7
    tokens = torch.tensor([[5, 9, 11, eos, 3, 4, 12, 13, eos, 8, 6, 2]])
    positions, document_ids = document_layout(tokens == eos)
    x = torch.randn(1, 12, args.dim)
    with torch.no_grad():
        packed = block(x, model.rope.cache[positions], build_dense_mask(document_ids))
        for start, end in [(0, 4), (4, 9), (9, 12)]:
            alone = block(x[:, start:end], model.rope.cache[:end - start], None)
            torch.testing.assert_close(packed[:, start:end], alone, rtol=1e-5, atol=1e-6)


def test_future_labels_stay_in_their_document() -> None:
    """Labels not masked at the document end, so that only the rule keeps targets in their document: inputs 0-2
    are one document and 3-5 the next, and labels[j] is the token j + 1 (token 6 follows the window)."""
    tokens = torch.tensor([[0, 1, 2, 3, 4, 5]])
    labels = tokens + 1
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 1]])
    ignored = IGNORE_INDEX
    assert future_labels(labels, None, 2).tolist() == [[3, 4, 5, 6, ignored, ignored]]
    # Depth 1, position i's target is token i + 2: 2 (same document), 3 and 4 (the next one from positions 1 and 2),
    # 5, then token 6 past the window (the last input's document, which position 4 shares).
    assert future_labels(labels, document_ids, 1).tolist() == [[2, ignored, ignored, 5, 6, ignored]]
    # Depth 2, token i + 3: position 0's is token 3, the next document's.
    assert future_labels(labels, document_ids, 2).tolist() == [[ignored, ignored, ignored, 6, ignored, ignored]]


def test_mtp_loss_enters_the_gradient_not_the_reported_loss() -> None:
    """The returned loss is the next-token loss, bit for bit as without MTP modules, and the MTP modules' loss adds
    mtp_loss_weight times its gradient: an equal-weight hand sum of the two gives the same gradients."""
    args = dataclasses.replace(DEEPSEEK_V3_FLAVORS["debugmodel_mtp"], vocab_size=VOCAB, max_seq_len=32, n_layers=2,
                               mtp_loss_weight=0.3, loss_chunk_size=0)
    torch.manual_seed(0)
    model = Transformer(args).train()
    init_weights(model)
    tokens = torch.randint(0, VOCAB, (2, 32))
    labels = torch.roll(tokens, -1, dims=1)
    loss = model(tokens, labels=labels)
    loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    mtp_sum = model.mtp.loss_sum.clone()
    model.zero_grad()
    with torch.no_grad():
        assert torch.equal(loss, model(tokens, labels=labels))  # evaluation skips the modules: the same value

    # By hand: the trunk's hidden states, MTP depth 1 on them, and the weighted sum.
    h = model.tok_embeddings(tokens)
    rope = model.rope.cache[:32]
    for layer in model.layers.values():
        h = layer(h, rope, None)
    main = F.cross_entropy(model.output(model.norm(h))[..., :VOCAB].flatten(0, 1), labels.flatten(), reduction="sum")
    module = model.mtp.depths["0"]
    h1 = module(h, model.tok_embeddings(F.pad(tokens[:, 1:], (0, 1))), rope, None)
    mtp = F.cross_entropy(model.output(module.norm(h1))[..., :VOCAB].flatten(0, 1),
                          future_labels(labels, None, 1).flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss, main)
    torch.testing.assert_close(mtp_sum, mtp.detach())
    (main + 0.3 * mtp).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_671b_has_the_published_parameter_counts() -> None:
    """DeepSeek-V3's report: 671B parameters, 37B activated per token (its MTP module, 14B more, aside)."""
    args = DEEPSEEK_V3_FLAVORS["671B"]
    with torch.device("meta"):
        model = Transformer(args)
    assert math.isclose(num_params(model, exclude_embedding=False) / 1e9, 671, abs_tol=0.5)
    assert math.isclose(num_active_params(model, args.moe, False, exclude_embedding=False) / 1e9, 37, abs_tol=0.6)


@pytest.mark.parametrize(("flags", "field"), [
    (["--parallelism.pipeline_parallel_degree", "2"], "--parallelism.pipeline_parallel_degree 2"),
    (["--parallelism.context_parallel_degree", "2"], "--parallelism.context_parallel_degree 2"),
    (["--parallelism.tensor_parallel_degree", "2"], "--parallelism.tensor_parallel_degree 2"),
])
def test_layouts_mtp_cannot_run_are_config_errors(flags: list[str], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_job_config(["--model.name", "deepseek_v3", "--model.flavor", "debugmodel_mtp", *flags], world_size=2)
