"""Hugging Face interop for GPT-OSS (titan/checkpoint/hf.py, hf_io.py with titan/models/gpt_oss/hf.py): Titan's model
against transformers' GptOssForCausalLM on the same weights, logits both ways and every weight's gradient, through
alternating sliding-window and full attention with sinks, biased projections, YaRN without truncation, a biased
router's softmax over its top-k logits, and biased experts computing the clamped SwiGLU, stored fused and interleaved
(gate_up_proj); and the release's MXFP4 experts dequantized on import as transformers dequantizes them, shard by
shard."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from titan.checkpoint.hf import hf_names, import_transforms, load_steps
from titan.checkpoint.hf_io import read_hf_weights, save_hf
from titan.models.common.hf_mapping import MXFP4
from titan.models.gpt_oss import GptOssArgs
from titan.models.gpt_oss.args import gpt_oss_moe

from harness.hf_models import (
    TOKENIZER,
    VOCAB,
    next_token_gradients,
    read_safetensors,
    sample_tokens,
    transformers_model,
)
from harness.models import build_for_comparison

# Every part of the release at test sizes: 4 layers (sliding, full, sliding, full) with a window shorter than the
# sample's 48 tokens, grouped kv heads, 8 experts of which 4 per token; widths multiples of 32 (MXFP4's blocks).
SMALL = GptOssArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=VOCAB, max_seq_len=64,
                   sliding_window=8, moe=gpt_oss_moe(8, top_k=4, hidden_dim=32))
# fp32 on both sides; the models differ in op order (SDPA's written-out softmax against eager attention with the
# sink column, grouped against per-expert matmuls).
LOGITS_TOLERANCE = {"rtol": 0.0, "atol": 2e-5}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, torch.nn.Module, Path]:
    """(Titan model, the transformers model its export loads as, the folder)."""
    folder = tmp_path_factory.mktemp("gpt_oss")
    model = build_for_comparison(SMALL, seed=1)
    save_hf(model.state_dict(), folder, SMALL, torch.float32, TOKENIZER)
    return model, transformers_model(folder), folder


def test_export_matches_transformers_logits(exported: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, hf_model, folder = exported
    assert type(hf_model).__name__ == "GptOssForCausalLM"
    assert hf_model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    tokens = sample_tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, model.user_logits(tokens), **LOGITS_TOLERANCE)
    assert sorted(read_safetensors(folder)) == sorted(hf_names(SMALL))
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "original_max_position_embeddings": 4096, "truncate": False}


def test_gradients_match_transformers(exported: tuple) -> None:
    """The next-token loss's gradient of every weight, Titan's against transformers' (whose experts are fused and
    transposed: gate_up_proj (experts, dim, 2 x hidden) holds w1's rows at the even columns, w3's at the odd)."""
    model, hf_model, _ = exported
    hf_grads = next_token_gradients(model, hf_model)
    got = {name: param.grad for name, param in model.named_parameters()}
    want = {"tok_embeddings.weight": hf_grads.pop("model.embed_tokens.weight"),
            "output.weight": hf_grads.pop("lm_head.weight"), "norm.weight": hf_grads.pop("model.norm.weight")}
    names = {"self_attn.sinks": "attention.sinks", "input_layernorm.weight": "attention_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.router.weight": "moe.router.gate.weight",
             "mlp.router.bias": "moe.router.gate.bias", "mlp.experts.down_proj_bias": "moe.experts.w2_bias",
             **{f"self_attn.{hf}.{kind}": f"attention.{titan}.{kind}"
                for hf, titan in (("v_proj", "wv"), ("o_proj", "wo")) for kind in ("weight", "bias")}}
    head_rows = torch.arange(SMALL.head_dim).view(2, -1).t().flatten()  # Titan row 2i + r is HF row r * 8 + i
    for layer in range(SMALL.n_layers):
        hf, block = f"model.layers.{layer}", f"layers.{layer}"
        want.update({f"{block}.{name}": hf_grads.pop(f"{hf}.{hf_name}") for hf_name, name in names.items()})
        for hf_name, name in (("q_proj", "wq"), ("k_proj", "wk")):
            for kind in ("weight", "bias"):
                grad = hf_grads.pop(f"{hf}.self_attn.{hf_name}.{kind}").unflatten(0, (-1, SMALL.head_dim))
                want[f"{block}.attention.{name}.{kind}"] = grad[:, head_rows].flatten(0, 1)
        gate_up = hf_grads.pop(f"{hf}.mlp.experts.gate_up_proj")
        gate_up_bias = hf_grads.pop(f"{hf}.mlp.experts.gate_up_proj_bias")
        want.update({f"{block}.moe.experts.w1": gate_up[..., 0::2].transpose(1, 2),
                     f"{block}.moe.experts.w3": gate_up[..., 1::2].transpose(1, 2),
                     f"{block}.moe.experts.w1_bias": gate_up_bias[..., 0::2],
                     f"{block}.moe.experts.w3_bias": gate_up_bias[..., 1::2],
                     f"{block}.moe.experts.w2": hf_grads.pop(f"{hf}.mlp.experts.down_proj").transpose(1, 2)})
    assert not hf_grads and sorted(want) == sorted(got)
    for name, grad in want.items():
        torch.testing.assert_close(got[name][:VOCAB], grad, rtol=1e-4, atol=1e-6, msg=name)


def transformers_gpt_oss(seed: int) -> torch.nn.Module:
    """transformers' GptOssForCausalLM of SMALL's shape, its weights drawn as harness.models.build_for_comparison
    draws Titan's (biases and sinks nonzero, the router wide)."""
    transformers = pytest.importorskip("transformers")
    moe = SMALL.moe
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=SMALL.dim, intermediate_size=moe.hidden_dim, num_hidden_layers=SMALL.n_layers,
        num_attention_heads=SMALL.n_heads, num_key_value_heads=SMALL.n_kv_heads, head_dim=SMALL.head_dim,
        num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k, sliding_window=SMALL.sliding_window,
        max_position_embeddings=SMALL.max_seq_len, rms_norm_eps=SMALL.norm_eps, tie_word_embeddings=False)
    torch.manual_seed(seed)
    hf_model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
            else:
                param.normal_(0.0, 0.5 if "router" in name or name.endswith(("bias", "sinks")) else 0.1)
    return hf_model.eval()


def test_transformers_folder_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder written by transformers' save_pretrained, read into a Titan model: the logits match."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf_model = transformers_gpt_oss(seed=2)
    hf_model.save_pretrained(tmp_path)
    model = build_for_comparison(SMALL, seed=3)
    model.load_state_dict(read_hf_weights(tmp_path, SMALL))
    tokens = sample_tokens()
    with torch.no_grad():
        torch.testing.assert_close(model.user_logits(tokens), hf_model(tokens).logits, **LOGITS_TOLERANCE)


def random_mxfp4(rows: int, columns: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 blocks (experts, rows, columns / 32, 16) of random E2M1 codes and their scales (experts, rows, columns
    / 32), E8M0 codes from 2**-11 to 2**-4: weights of about the size of the other weights' (std 0.1)."""
    groups = columns // 32
    blocks = torch.randint(0, 256, (SMALL.moe.num_experts, rows, groups, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(116, 124, (SMALL.moe.num_experts, rows, groups), generator=generator, dtype=torch.uint8)
    return blocks, scales


def release_folder(folder: Path, hf_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Write `hf_model` as openai/gpt-oss-20b's release stores it (experts' weights as MXFP4 blocks and scales, the
    rest in bf16, config.json with its quantization_config) and set its expert weights to transformers' own
    dequantization of those blocks (integrations/mxfp4.py), which it returns by name."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(4)
    hf_model.save_pretrained(folder)
    tensors = read_safetensors(folder)
    dequantized = {}
    for name in [name for name in tensors if name.endswith(("gate_up_proj", "down_proj"))]:
        rows, columns = ((2 * SMALL.moe.hidden_dim, SMALL.dim) if name.endswith("gate_up_proj")
                         else (SMALL.dim, SMALL.moe.hidden_dim))
        blocks, scales = random_mxfp4(rows, columns, generator)
        del tensors[name]
        tensors.update({f"{name}_blocks": blocks, f"{name}_scales": scales})
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    for path in folder.glob("*.safetensors"):
        path.unlink()
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, folder / "model.safetensors")
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    hf_model.load_state_dict(dequantized, strict=False)
    return dequantized


def test_mxfp4_release_imports_as_transformers_dequantizes_it(tmp_path: Path) -> None:
    """A folder in the release's layout imports: Titan's experts are transformers' dequantized weights exactly (E2M1
    codes times powers of two are exact in fp32), so the logits match transformers' model of them."""
    hf_model = transformers_gpt_oss(seed=5)
    dequantized = release_folder(tmp_path, hf_model)
    assert any(isinstance(t, MXFP4) for t in import_transforms(SMALL, read_safetensors(tmp_path)))
    state_dict = read_hf_weights(tmp_path, SMALL)
    for layer in range(SMALL.n_layers):
        experts = f"layers.{layer}.moe.experts"
        gate_up = dequantized[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        assert torch.equal(state_dict[f"{experts}.w1"], gate_up[..., 0::2].transpose(1, 2))
        assert torch.equal(state_dict[f"{experts}.w3"], gate_up[..., 1::2].transpose(1, 2))
        assert torch.equal(state_dict[f"{experts}.w2"],
                           dequantized[f"model.layers.{layer}.mlp.experts.down_proj"].transpose(1, 2))
    model = build_for_comparison(SMALL, seed=3)
    model.load_state_dict(state_dict)
    tokens = sample_tokens()
    with torch.no_grad():
        torch.testing.assert_close(model.user_logits(tokens), hf_model(tokens).logits, **LOGITS_TOLERANCE)


@pytest.mark.parametrize("fqn", ["w1", "w3", "w2"])
def test_mxfp4_chunks_cut_inside_blocks_read_their_own_values(fqn: str) -> None:
    """A shard's chunk whose experts, rows and columns start and end inside the blocks (columns 40 to 59 cut two
    32-column groups) reads the blocks and scales around it and takes exactly its own values of the dequantized
    weight, as a rank of a sharded import does."""
    transform = next(t for t in import_transforms(SMALL, MXFP4_NAMES) if isinstance(t, MXFP4)
                     and f"layers.0.moe.experts.{fqn}" in t.fqns)
    generator = torch.Generator().manual_seed(6)
    rows = len(transform.fqns) * (SMALL.moe.hidden_dim if fqn != "w2" else SMALL.dim)
    columns = SMALL.dim if fqn != "w2" else SMALL.moe.hidden_dim
    blocks, scales = random_mxfp4(rows, columns, generator)
    stored = {f"{transform.hf}_blocks": blocks, f"{transform.hf}_scales": scales}
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    whole = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # (experts, rows, cols)
    phase = transform.fqns.index(f"layers.0.moe.experts.{fqn}")
    weight = whole[:, phase::len(transform.fqns)]
    first, size = (1, 3, 12), (2, 5, 20)
    local = torch.full(size, float("nan"))
    for step in load_steps(transform, f"layers.0.moe.experts.{fqn}", (local, first), VOCAB):
        step.place([stored[box.name][tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))]
                    for box in step.boxes])
    want = weight[tuple(slice(o, o + n) for o, n in zip(first, size))]
    assert torch.equal(local, want)


MXFP4_NAMES = {f"model.layers.0.mlp.experts.{name}_{part}" for name in ("gate_up_proj", "down_proj")
               for part in ("blocks", "scales")}


def test_export_of_a_debug_flavor_checks_its_shapes(tmp_path: Path) -> None:
    """The exported config.json describes the flavor (sliding window, layer types, experts) and reads back."""
    args = dataclasses.replace(SMALL, sliding_window=16)
    model = build_for_comparison(args, seed=1)
    save_hf(model.state_dict(), tmp_path, args, torch.float32, TOKENIZER)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["sliding_window"], config["num_local_experts"], config["attention_bias"]) == (16, 8, True)
    read_back = read_hf_weights(tmp_path, args)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(read_back[name][:VOCAB], tensor[:VOCAB], rtol=0, atol=0, msg=name)
