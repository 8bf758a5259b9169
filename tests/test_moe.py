"""Mixtures of experts (titan/models/common/moe.py), on Qwen3's MoE flavor: routing, the grouped matmuls, the
load-balancing loss and bias, token counts under recompute and pipelines, expert parallel's token exchange, and the
layouts a mixture of experts refuses. (The Qwen3 family's own shapes: tests/test_qwen3.py; DeepSeek-V3's routing:
tests/test_deepseek_v3.py.)"""

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from titan.config.errors import ConfigError
from titan.models.common import moe as moe_module
from titan.models.common.moe import (
    READ_COUNTS,
    HighPrecisionMatmuls,
    MoE,
    MoEArgs,
    Router,
    load_balancing_loss,
    swiglu_expert,
)
from titan.models.qwen3 import QWEN3_FLAVORS
from titan.parallel.ac import op_sac_context
from titan.parallel.dims import resolve_dims
from titan.parallel.ep import expert_major_order
from titan.train.expert_balance import ExpertBalancer, build_expert_balancer
from titan.validate import load_job_config

from harness.torchrun import run_torchrun

MOE = MoEArgs(num_experts=4, top_k=2, hidden_dim=16)
CPU = torch.device("cpu")


def build_moe(args: MoEArgs = MOE, dim: int = 8, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(dim, args)
    for weight in (layer.router.gate.weight, layer.experts.w1, layer.experts.w2, layer.experts.w3):
        torch.nn.init.normal_(weight, std=0.5)
    return layer


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   w3: torch.Tensor) -> torch.Tensor:
    """The high-precision experts' SwiGLU over x's blocks of counts rows."""
    return HighPrecisionMatmuls()(x, counts, {"w1": w1, "w2": w2, "w3": w3}, swiglu_expert, READ_COUNTS)


def dense_moe_reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, each token's output the routed experts' outputs weighted by the router: the
    definition, with none of the sorting, grouping or scattering."""
    tokens = x.reshape(-1, x.size(-1))
    weights, experts, _ = layer.router(tokens)
    outputs = torch.stack([grouped_swiglu(tokens, torch.tensor([tokens.size(0)]), layer.experts.w1[e:e + 1],
                                          layer.experts.w2[e:e + 1], layer.experts.w3[e:e + 1])
                           for e in range(layer.experts.num_experts)], dim=1)  # (tokens, experts, dim)
    picked = outputs.gather(1, experts[..., None].expand(-1, -1, tokens.size(-1)))  # (tokens, top_k, dim)
    return (picked * weights[..., None]).sum(dim=1).view_as(x)


def test_moe_matches_every_expert_on_every_token() -> None:
    layer = build_moe()
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(layer(x), dense_moe_reference(layer, x), rtol=1e-5, atol=1e-6)


def test_router_renormalises_the_top_k_and_the_bias_only_steers_the_choice() -> None:
    router = Router(8, dataclasses.replace(MOE, load_balance_coeff=1e-3))
    torch.nn.init.normal_(router.gate.weight)
    x = torch.randn(6, 8)
    weights, experts, probs = router(x)
    torch.testing.assert_close(weights.sum(-1), torch.ones(6))
    torch.testing.assert_close(weights, probs.gather(-1, experts) / probs.gather(-1, experts).sum(-1, keepdim=True))
    # A bias large enough to force experts 2 and 3: the choice follows it, the weights stay the probabilities'.
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 10.0, 20.0]))
    weights, experts, probs = router(x)
    assert (experts == torch.tensor([3, 2])).all()
    torch.testing.assert_close(weights, probs[:, [3, 2]] / probs[:, [3, 2]].sum(-1, keepdim=True))
    unnormalised = Router(8, dataclasses.replace(MOE, norm_topk_prob=False))
    unnormalised.gate.weight.data.copy_(router.gate.weight)
    weights, experts, probs = unnormalised(x)
    torch.testing.assert_close(weights, probs.gather(-1, experts))


@pytest.mark.parametrize("counts", [[3, 0, 7], [0, 0, 10], [10, 0, 0]], ids=["middle-empty", "first-empty", "one"])
def test_grouped_matmuls_match_the_loop_over_experts(monkeypatch: pytest.MonkeyPatch, counts: list[int]) -> None:
    torch.manual_seed(0)
    x = torch.randn(10, 16, requires_grad=True)
    weights = [torch.randn(3, 8, 16, requires_grad=True), torch.randn(3, 16, 8, requires_grad=True),
               torch.randn(3, 8, 16, requires_grad=True)]
    upstream = torch.randn(10, 16)

    def run() -> list[torch.Tensor]:
        for tensor in (x, *weights):
            tensor.grad = None
        out = grouped_swiglu(x, torch.tensor(counts), *weights)
        (out * upstream).sum().backward()
        return [out.detach(), x.grad, *(w.grad for w in weights)]

    assert moe_module.grouped_mm_supported(x)  # torch._grouped_mm on the CPU
    grouped = run()
    monkeypatch.setattr(moe_module, "grouped_mm_supported", lambda x, token_counts: False)
    for got, want in zip(grouped, run()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_load_balancing_loss_by_hand() -> None:
    # 4 tokens, 2 experts, top 1: expert 0 gets 3 tokens, expert 1 one.
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.7, 0.3], [0.2, 0.8]])
    counts = torch.tensor([3.0, 1.0])
    # num_experts x sum_e (tokens to e / tokens) x mean probability of e = 2 x (3/4 x 0.6 + 1/4 x 0.4) = 1.1
    assert load_balancing_loss(probs, counts).item() == pytest.approx(1.1)
    # Perfect balance gives top_k (here 1), its minimum.
    even = torch.tensor([[0.5, 0.5]] * 4)
    assert load_balancing_loss(even, torch.tensor([2.0, 2.0])).item() == pytest.approx(1.0)


def test_auxiliary_loss_reaches_the_router_without_changing_the_output() -> None:
    weight = 0.25
    with_loss = build_moe(dataclasses.replace(MOE, aux_loss_weight=weight))
    without = build_moe()
    x = torch.randn(2, 6, 8)
    upstream = torch.randn(2, 6, 8)
    out = with_loss(x)
    torch.testing.assert_close(out, without(x))
    (out * upstream).sum().backward()
    # The same gradient as adding weight x the layer's loss to the objective by hand.
    tokens = x.reshape(-1, 8)
    weights_, experts, probs = without.router(tokens)
    counts = torch.bincount(experts.flatten(), minlength=4).float()
    objective = (without(x) * upstream).sum() + weight * load_balancing_loss(probs, counts)
    objective.backward()
    torch.testing.assert_close(with_loss.router.gate.weight.grad, without.router.gate.weight.grad)
    assert with_loss.router.gate.weight.grad.ne(0).any()


def test_token_counts_skip_forwards_without_gradients() -> None:
    layer = build_moe()
    x = torch.randn(2, 5, 8)
    layer(x)
    assert layer.tokens_per_expert.sum().item() == 2 * 5 * 2  # every token's top 2
    with torch.no_grad():
        layer(x)  # evaluation, or a pipeline stage's shape inference
    layer.eval()
    layer(x)
    assert layer.tokens_per_expert.sum().item() == 20


@pytest.mark.parametrize("checkpointing", ["full", "selective_op", "full_compiled"])
def test_a_recomputed_block_counts_its_routed_tokens_once(checkpointing: str) -> None:
    """Activation checkpointing runs a block's forward again in backward: the counts are the routed copies of the
    forward, 2 x 5 tokens x top 2, as without checkpointing. Compiled, the recompute is part of the backward graph,
    which does not replay the forward's update of the counts."""
    block = torch.nn.Module()
    block.moe = build_moe()
    block.forward = lambda x: block.moe(x)
    context = {"context_fn": op_sac_context} if checkpointing == "selective_op" else {}
    wrapped = checkpoint_wrapper(block, preserve_rng_state=False, **context)
    if checkpointing == "full_compiled":
        wrapped.compile(backend="aot_eager")
    x = torch.randn(2, 5, 8, requires_grad=True)
    wrapped(x).sum().backward()
    assert x.grad.ne(0).any()
    assert block.moe.tokens_per_expert.sum().item() == 2 * 5 * 2


def test_a_pipeline_rank_without_experts_still_takes_part_in_the_count() -> None:
    """A pipeline rank whose stages hold only dense blocks (DeepSeek-V3's first) keeps a balancer: its table is
    all zero rows, so its share of the all-reduce its peers run over every rank is nothing, and the load it reports
    (none of its own) comes from theirs."""
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"0": torch.nn.Linear(8, 8)})})
    model.args = dataclasses.replace(QWEN3_FLAVORS["debugmodel_moe"], n_layers=3)
    balancer = build_expert_balancer(model, MOE, coeff=0.01, count_mesh=None, device=CPU)
    assert balancer is not None and not balancer.layers
    assert torch.equal(balancer.count_table(), torch.zeros(3, 4 + 1))
    assert build_expert_balancer(model, None, coeff=0.01, count_mesh=None, device=CPU) is None


def test_balancer_moves_biases_towards_the_mean_and_resets_the_counts() -> None:
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"0": torch.nn.Module()})})
    model.layers["0"].moe = build_moe(dataclasses.replace(MOE, load_balance_coeff=0.01))
    layer = model.layers["0"].moe
    layer.tokens_per_expert.copy_(torch.tensor([6.0, 2.0, 4.0, 4.0]))
    balancer = ExpertBalancer(model, num_blocks=1, num_experts=4, coeff=0.01, count_mesh=None, device=CPU)
    balancer.after_optimizer_step(skip=torch.tensor(True))  # a skipped update leaves the bias
    torch.testing.assert_close(layer.router.expert_bias, torch.zeros(4))
    assert layer.tokens_per_expert.sum() == 0
    layer.tokens_per_expert.copy_(torch.tensor([6.0, 2.0, 4.0, 4.0]))
    balancer.after_optimizer_step(skip=None)
    torch.testing.assert_close(layer.router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    metrics = balancer.load_metrics()
    assert metrics["moe_imbalance"] == pytest.approx(6 / 4)
    assert metrics["tokens_per_expert"] == {"layers.0": [6, 2, 4, 4]}


def test_load_metrics_name_each_layer_by_its_block_in_the_whole_model() -> None:
    """A pipeline stage holding only block 2 of 4, checkpoint-wrapped (activation checkpointing puts
    _checkpoint_wrapped_module in its module path): its load is reported as layers.2, the whole model's FQN, and no
    other block is reported (none is counted here, and no other stage adds to this one's table)."""
    block = torch.nn.Module()
    block.moe = build_moe()
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"2": checkpoint_wrapper(block)})})
    block.moe.tokens_per_expert.copy_(torch.tensor([3.0, 5.0, 4.0, 4.0]))
    balancer = ExpertBalancer(model, num_blocks=4, num_experts=4, coeff=0.01, count_mesh=None, device=CPU)
    balancer.after_optimizer_step(skip=None)
    assert balancer.load_metrics() == {"moe_imbalance": pytest.approx(5 / 4), "tokens_per_expert": {
        "layers.2": [3, 5, 4, 4]}}


def test_received_tokens_are_regrouped_by_expert() -> None:
    # 2 ranks x 2 local experts; rank 0 sent 1 token to expert 0 and 2 to expert 1, rank 1 sent 3 and 0.
    order = expert_major_order(torch.tensor([1, 2, 3, 0]), ep=2, local=2, num_rows=6)
    # rows: r0e0 (0) | r0e1 (1, 2) | r1e0 (3, 4, 5) -> e0: 0, 3, 4, 5 then e1: 1, 2
    assert order.tolist() == [0, 3, 4, 5, 1, 2]


def test_every_token_reaches_its_experts_once_across_ep_ranks(tmp_path: Path) -> None:
    """Outputs, input gradients and expert gradients of 2 EP ranks equal the whole experts' on each rank's tokens,
    with experts that get no token and a rank whose experts get none from the other."""
    result = tmp_path / "ep.pt"
    run_torchrun("ep_harness.py", 2, str(result))
    for rank, routings in enumerate(torch.load(result)):
        for name, got in routings.items():
            for key in ("out", "x_grad", "w1_grad", "w2_grad", "w3_grad"):
                torch.testing.assert_close(got[key], got[f"want_{key}"], rtol=1e-5, atol=1e-5,
                                           msg=f"rank {rank}, routing {name}, {key}")


QWEN3 = ["--model.name", "qwen3"]
MOE_FLAVOR = [*QWEN3, "--model.flavor", "debugmodel_moe"]


@pytest.mark.parametrize("flags, world_size, expected", [
    (["--model.flavor", "debugmodel_moe"], 1, "--model.flavor debugmodel_moe is not a flavor of --model.name llama3 "
                                              "(it is a qwen3 flavor)"),
    ([*QWEN3, "--model.flavor", "70B"], 1, "--model.flavor 70B is not a flavor of --model.name qwen3 (it is a llama3"),
    ([*QWEN3, "--parallelism.expert_parallel_degree", "2"], 2,
     "--parallelism.expert_parallel_degree 2 needs a mixture-of-experts flavor"),
    ([*QWEN3, "--moe.aux_loss_weight", "0.001"], 1, "--moe.aux_loss_weight 0.001 only applies to mixture-of-experts"),
    ([*MOE_FLAVOR, "--parallelism.expert_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
      "--parallelism.data_parallel_replicate_degree", "2"], 2,
     "--parallelism.expert_parallel_degree 2 must divide --parallelism.data_parallel_shard_degree 1"),
    ([*MOE_FLAVOR, "--parallelism.expert_parallel_degree", "3"], 3, "must divide the 8 experts"),
    ([*MOE_FLAVOR, "--parallelism.tensor_parallel_degree", "2"], 2,
     "--parallelism.tensor_parallel_degree 2 does not combine with the mixture-of-experts flavor"),
    ([*QWEN3, "--model.flavor", "0.6B", "--parallelism.pipeline_parallel_degree", "2"], 2,
     "--model.flavor 0.6B ties its output layer to the token embedding"),
], ids=["llama-without-moe-flavor", "qwen3-without-70b", "ep-on-dense", "aux-on-dense", "ep-beyond-dp-shard",
        "ep-not-dividing-experts", "moe-with-tp", "tied-with-pp"])
def test_family_and_expert_layout_mistakes_are_config_errors(flags: list[str], world_size: int,
                                                             expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_job_config(flags, world_size=world_size)
    assert expected in str(error.value)


def test_expert_parallel_borrows_data_parallel_ranks() -> None:
    cfg = load_job_config([*MOE_FLAVOR, "--parallelism.expert_parallel_degree", "2"], world_size=4)
    dims = resolve_dims(cfg.parallelism, 4, cpu_offload=False)
    assert (dims.dp_shard, dims.ep, dims.expert_fsdp, dims.world_size) == (4, 2, 2, 4)
