"""Muon (titan/train/muon.py) on one process against torch's own: Newton-Schulz op for op, the whole optimizer against
torch.optim.Muon on the hidden matrices and torch.optim.AdamW on the rest (experts slice by slice through torch's
single-tensor Muon, which refuses 3-D parameters), bit for bit; which parameter goes where; a step skipped on the
device; the config's refusals. (Sharded: tests/test_parallel.py; checkpoints: tests/test_checkpoint.py.)"""

import dataclasses
import logging

import pytest
import torch
from torch import nn
from torch.optim._muon import _single_tensor_muon, _zeropower_via_newtonschulz

from titan.config.errors import ConfigError
from titan.config.job import Optimizer
from titan.models.deepseek_v3 import DEEPSEEK_V3_FLAVORS
from titan.models.gpt_oss import GPT_OSS_FLAVORS
from titan.models.llama.args import LLAMA3_FLAVORS
from titan.models.qwen3 import QWEN3_FLAVORS
from titan.train.muon import newton_schulz, newton_schulz_bound
from titan.train.optim import build_optimizer, ns_coefficients
from titan.validate import load_job_config

from harness.models import build_model

NS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)
LLAMA = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            vocab_size=256, max_seq_len=32)
QWEN3_MOE = dataclasses.replace(QWEN3_FLAVORS["debugmodel_moe"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                head_dim=16, vocab_size=256, max_seq_len=32)
# Every part of their families (MLA's fused wkv_a, MTP's eh_proj, shared experts; sinks, biased experts and router).
DEEPSEEK_V3 = dataclasses.replace(
    DEEPSEEK_V3_FLAVORS["debugmodel_mtp"], dim=64, n_heads=4, n_kv_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, hidden_dim=128, vocab_size=256, max_seq_len=32,
    moe=dataclasses.replace(DEEPSEEK_V3_FLAVORS["debugmodel_mtp"].moe, hidden_dim=32))
GPT_OSS = dataclasses.replace(GPT_OSS_FLAVORS["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              head_dim=16, vocab_size=256, max_seq_len=32)
MUON = Optimizer(name="Muon", lr=2e-2, weight_decay=0.1, momentum=0.9, implementation="fused")


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48), (100, 7), (33, 65)], ids=str)
def test_newton_schulz_is_torchs_op_for_op(shape: tuple[int, int]) -> None:
    """Wide, tall, square, odd: the same bits as torch.optim.Muon's iteration. A stack (experts), batched, is each
    matrix's result within one bfloat16 rounding (2^-7 relative): a batched matmul may sum in another order (3 of 144
    stacks of these shapes differ in some element, by one rounding)."""
    for seed in range(3):
        matrix = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(newton_schulz(matrix, *NS), _zeropower_via_newtonschulz(matrix, *NS))
        stack = torch.randn(3, *shape, generator=torch.Generator().manual_seed(seed + 10))
        torch.testing.assert_close(newton_schulz(stack, *NS),
                                   torch.stack([_zeropower_via_newtonschulz(m, *NS) for m in stack]),
                                   rtol=2**-7, atol=2**-10)


def groups_by_algorithm(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, set[str]]:
    names = {id(param): fqn for fqn, param in model.named_parameters()}
    found: dict[str, set[str]] = {"muon": set(), "adamw": set()}
    for group in optimizer.param_groups:
        found[group["algorithm"]] |= {names[id(param)] for param in group["params"]}
    return found


def test_hidden_matrices_train_with_muon_and_the_rest_with_adamw(caplog: pytest.LogCaptureFixture) -> None:
    """The hidden layers' weights (each projection, each expert stack) go to Muon; the embedding, the output, norms,
    QK-norms, routers and what --optimizer.adamw_fqns names go to AdamW; the groups are logged."""
    model = build_model(QWEN3_MOE)
    with caplog.at_level(logging.INFO, logger="titan"):
        found = groups_by_algorithm(build_optimizer(model, MUON), model)
    assert found["muon"] == {f"layers.{i}.{name}" for i in range(2) for name in (
        "attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
        "moe.experts.w1", "moe.experts.w2", "moe.experts.w3")}
    assert {"tok_embeddings.weight", "output.weight", "norm.weight", "layers.0.moe.router.gate.weight",
            "layers.1.attention.q_norm.weight"} <= found["adamw"]
    assert any(record.getMessage().startswith("Optimizer group: Muon 14 parameters (hidden matrices")
               for record in caplog.records)
    moved = groups_by_algorithm(build_optimizer(model, dataclasses.replace(MUON, adamw_fqns=["wo"])), model)
    assert "layers.0.attention.wo.weight" in moved["adamw"] and len(moved["muon"]) == 12


def test_each_familys_own_parts_go_to_the_right_algorithm() -> None:
    """DeepSeek-V3's fused wkv_a, shared experts and MTP projection are Muon's, its kv_norm AdamW's; GPT-OSS's
    sinks, projection biases, experts' biases and biased router are AdamW's."""
    model = build_model(DEEPSEEK_V3)
    found = groups_by_algorithm(build_optimizer(model, MUON), model)
    assert {"layers.1.attention.wkv_a.weight", "layers.1.moe.shared_experts.w1.weight",
            "mtp.depths.0.eh_proj.weight", "mtp.depths.0.block.attention.wq.weight"} <= found["muon"]
    assert {"layers.1.attention.kv_norm.weight", "mtp.depths.0.enorm.weight",
            "layers.1.moe.router.gate.weight"} <= found["adamw"]
    model = build_model(GPT_OSS)
    found = groups_by_algorithm(build_optimizer(model, MUON), model)
    assert found["muon"] == {f"layers.{i}.{name}" for i in range(2) for name in (
        "attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
        "moe.experts.w1", "moe.experts.w2", "moe.experts.w3")}
    assert {"layers.0.attention.sinks", "layers.0.attention.wq.bias", "layers.0.moe.experts.w1_bias",
            "layers.0.moe.router.gate.bias", "layers.0.moe.router.gate.weight"} <= found["adamw"]


def reference_step(model: nn.Module, muon: list[nn.Parameter], adamw_groups: list[dict], cfg: Optimizer,
                   state: dict) -> None:
    """torch's Muon on each 2-D matrix and each expert matrix (a view of the stack), and torch's AdamW on the rest,
    with the same settings."""
    matrices, grads, buffers = [], [], []
    for param in muon:
        buffer = state.setdefault(id(param), torch.zeros_like(param))
        for matrix, grad, matrix_buffer in ([(param, param.grad, buffer)] if param.dim() == 2 else
                                            zip(param.unbind(0), param.grad.unbind(0), buffer.unbind(0))):
            matrices.append(matrix)
            grads.append(grad)
            buffers.append(matrix_buffer)
    with torch.no_grad():
        _single_tensor_muon(matrices, grads, buffers, lr=cfg.lr, weight_decay=cfg.weight_decay,
                            momentum=cfg.momentum, nesterov=cfg.nesterov, ns_coefficients=ns_coefficients(cfg),
                            ns_steps=cfg.ns_steps, eps=cfg.ns_eps, adjust_lr_fn=cfg.adjust_lr_fn, has_complex=False)
    state["adamw"].step()


@pytest.mark.parametrize("args, nesterov, adjust_lr_fn", [(LLAMA, True, "match_rms_adamw"),
                                                          (QWEN3_MOE, False, "original"),
                                                          (DEEPSEEK_V3, True, "match_rms_adamw"),
                                                          (GPT_OSS, True, "original")],
                         ids=["llama", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_muon_equals_torchs_muon_and_adamw_bit_for_bit(args: object, nesterov: bool, adjust_lr_fn: str) -> None:
    """Three steps on the same gradients: every parameter equals torch.optim.Muon's and torch.optim.AdamW's result,
    bit for bit (the experts, run as stacks, matrix by matrix through torch's Muon, within the stacks' rounding: at
    lr 0.02 an update's one bfloat16 rounding moves a weight by 4e-5); a step under a set found_inf leaves every
    parameter and the momentum as they were, and one under a clear found_inf is the plain step."""
    cfg = dataclasses.replace(MUON, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    model, reference = build_model(args), build_model(args)
    optimizer = build_optimizer(model, cfg)
    by_name = dict(reference.named_parameters())
    names = {id(param): fqn for fqn, param in model.named_parameters()}
    muon = [by_name[names[id(p)]] for g in optimizer.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    adamw_groups = [{**{key: g[key] for key in ("weight_decay", "lr")},
                     "params": [by_name[names[id(p)]] for p in g["params"]]}
                    for g in optimizer.param_groups if g["algorithm"] == "adamw"]
    state = {"adamw": torch.optim.AdamW(adamw_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                        fused=True)}
    generator = torch.Generator().manual_seed(2)
    for step in range(4):
        grads = {fqn: torch.randn(param.shape, generator=generator) for fqn, param in model.named_parameters()}
        for trained in (model, reference):
            for fqn, param in trained.named_parameters():
                param.grad = grads[fqn].clone()
        before = {fqn: param.detach().clone() for fqn, param in model.named_parameters()}
        if step == 2:  # a skipped step: nothing moves, on either side
            optimizer.found_inf = torch.ones(())
            optimizer.step()
            del optimizer.found_inf
            for fqn, param in model.named_parameters():
                assert torch.equal(param, before[fqn]), fqn
            continue
        if step == 3:
            optimizer.found_inf = torch.zeros(())
        optimizer.step()
        optimizer.__dict__.pop("found_inf", None)
        reference_step(reference, muon, adamw_groups, cfg, state)
        for fqn, param in model.named_parameters():
            if ".experts." in fqn and param.dim() == 3:
                torch.testing.assert_close(param, by_name[fqn], rtol=0, atol=2e-4, msg=f"step {step}: {fqn}")
            else:
                assert torch.equal(param, by_name[fqn]), f"step {step}: {fqn}"
            assert not torch.equal(param, before[fqn]), f"step {step}: {fqn} did not move"


@pytest.mark.parametrize("flags, message", [
    (["--optimizer.name", "Muon", "--optimizer.ns_b", "4.775"],
     r"--optimizer\.ns_a 3\.4445, --optimizer\.ns_b 4\.775, --optimizer\.ns_c 2\.0315 and --optimizer\.ns_steps 5 "
     r"take a singular value"),
    (["--optimizer.name", "Muon", "--optimizer.state_dtype", "bfloat16"], r"--optimizer\.state_dtype bfloat16"),
    (["--optimizer.name", "Muon", "--training.enable_cpu_offload"], r"--training\.enable_cpu_offload"),
    (["--optimizer.momentum", "0.9"], r"--optimizer\.momentum is Muon's"),
    (["--optimizer.name", "Muon", "--optimizer.adamw_fqns", "attention.wx"], r"--optimizer\.adamw_fqns"),
], ids=["diverging", "bf16-state", "cpu-offload", "without-muon", "unknown-pattern"])
def test_bad_muon_settings_are_config_errors(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_job_config(flags, world_size=1)


def test_muon_with_no_matrix_is_a_config_error() -> None:
    model = build_model(LLAMA)
    with pytest.raises(ConfigError, match="has no weight matrix to update"):
        build_optimizer(model, dataclasses.replace(MUON, adamw_fqns=["layers."]))


def test_the_default_coefficients_keep_singular_values_bounded() -> None:
    """The defaults take no singular value of [0, 1] past 1.3 (they need not converge to 1: Jordan's coefficients
    leave them in about [0.7, 1.2]); coefficients with the wrong sign on b blow up within 5 steps."""
    _, worst = newton_schulz_bound(*NS[:2])
    assert 1.0 < abs(worst) < 1.3
    assert abs(newton_schulz_bound((3.4445, 4.775, 2.0315), 5)[1]) > 1e6
