"""Hugging Face interop for DeepSeek-V3 (titan/checkpoint/hf.py, hf_io.py with titan/models/deepseek_v3/hf.py):
Titan's model against transformers' DeepseekV3ForCausalLM on the same weights, logits both ways and gradients, with
the query's one projection and its low-rank path, YaRN with and without an attention factor, dense first layers,
sigmoid group-limited routing with a correction bias, shared experts; multi-token prediction modules left out of an
export and skipped in an import."""

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from titan.checkpoint.hf import export_transforms, hf_names, load_steps
from titan.checkpoint.hf_io import dequantized as dequantized_step
from titan.checkpoint.hf_io import inspect_folder, read_hf_weights, save_hf
from titan.config.errors import ConfigError
from titan.models.common.args import YarnScaling
from titan.models.common.hf_mapping import Same, VocabRows
from titan.models.common.moe import MoEArgs
from titan.models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args, Transformer, init_weights

from harness.hf_models import (
    TOKENIZER,
    VOCAB,
    next_token_gradients,
    read_safetensors,
    sample_tokens,
    spread_transformers_weights,
    transformers_model,
)
from harness.models import build_for_comparison

HUB_ROWS = 2304  # a hub checkpoint's rows past the tokenizer's, as DeepSeek-V3's 129280 for 128815 tokens
# V2-Lite's YaRN (mscale = mscale_all_dim: no attention factor on the rotation, a softmax temperature).
SMALL = DeepSeekV3Args(
    dim=64, n_layers=3, n_heads=4, n_kv_heads=4, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, hidden_dim=96, first_k_dense_replace=1, vocab_size=VOCAB, max_seq_len=64,
    rope_scaling=YarnScaling(factor=40.0, mscale=0.707, mscale_all_dim=0.707),
    moe=MoEArgs(num_experts=8, top_k=3, hidden_dim=32, score_func="sigmoid", n_group=4, topk_group=2,
                routed_scaling_factor=2.5, num_shared_experts=1, expert_bias=True))
# DeepSeek-V3's low-rank query, an attention factor on the rotation (mscale != mscale_all_dim), and an MTP module.
LOW_RANK_MTP = dataclasses.replace(SMALL, q_lora_rank=24, mtp_depth=1, mtp_loss_weight=0.3,
                                   rope_scaling=YarnScaling(factor=40.0, mscale=1.0, mscale_all_dim=0.707))
VARIANTS = {"query_projection": SMALL, "low_rank_query_mtp": LOW_RANK_MTP}
# fp32 on both sides; the models differ in op order (SDPA vs eager attention, grouped vs per-expert matmuls, the
# softmax temperature on q vs on the scores).
LOGITS_TOLERANCE = {"rtol": 0.0, "atol": 2e-5}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[DeepSeekV3Args, Transformer, torch.nn.Module, Path]:
    """(args, Titan model, the transformers model its export loads as, the folder)."""
    args = VARIANTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    model = build_for_comparison(args, seed=1, routing_bias=True)
    save_hf(model.state_dict(), folder, args, torch.float32, TOKENIZER)
    return args, model, transformers_model(folder), folder


def test_export_matches_transformers_logits(exported: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args, model, hf_model, folder = exported
    assert type(hf_model).__name__ == "DeepseekV3ForCausalLM"
    tokens = sample_tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, model.user_logits(tokens), **LOGITS_TOLERANCE)
    hf = read_safetensors(folder)
    assert sorted(hf) == sorted(hf_names(args))
    assert not any(name.startswith("mtp") or ".layers.3." in name for name in hf)  # MTP modules are not exported
    config = json.loads((folder / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 0 and config["rope_scaling"]["rope_type"] == "yarn"


def test_gradients_match_transformers(exported: tuple) -> None:
    """The next-token loss's gradient of every weight, Titan's against transformers' (whose experts are fused:
    gate_up_proj holds w1 over w3)."""
    args, model, hf_model, _ = exported
    hf_grads = next_token_gradients(model, hf_model)
    titan = dict(model.named_parameters())
    checked = set()
    for transform in export_transforms(args):
        if isinstance(transform, (Same, VocabRows)) and transform.fqn in titan and transform.hf in hf_grads:
            torch.testing.assert_close(titan[transform.fqn].grad[:VOCAB], hf_grads[transform.hf], rtol=1e-4,
                                       atol=1e-6)
            checked.add(transform.hf)
    for layer in range(args.first_k_dense_replace, args.n_layers):
        experts, hf_experts = model.layers[str(layer)].moe.experts, f"model.layers.{layer}.mlp.experts"
        w1, w3 = hf_grads[f"{hf_experts}.gate_up_proj"].chunk(2, dim=1)
        for got, want in [(experts.w1, w1), (experts.w3, w3), (experts.w2, hf_grads[f"{hf_experts}.down_proj"])]:
            torch.testing.assert_close(got.grad, want, rtol=1e-4, atol=1e-6)
        checked |= {f"{hf_experts}.gate_up_proj", f"{hf_experts}.down_proj"}
    assert checked == set(hf_grads)


def test_transformers_folder_with_mtp_layer_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     titan_records: list[logging.LogRecord]) -> None:
    """A folder written by transformers' save_pretrained, with the hub's extra vocab rows and an MTP module stored as
    the layer past the last (as deepseek-ai/DeepSeek-V3 stores its layer 61), read into a Titan model with MTP
    modules: the logits match, the MTP layer is skipped and Titan's MTP modules keep their init."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args, moe = LOW_RANK_MTP, LOW_RANK_MTP.moe
    yarn = args.rope_scaling
    config = transformers.DeepseekV3Config(
        vocab_size=HUB_ROWS, hidden_size=args.dim, intermediate_size=args.hidden_dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads, q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_nope_head_dim,
        qk_rope_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim,
        first_k_dense_replace=args.first_k_dense_replace, moe_intermediate_size=moe.hidden_dim,
        n_routed_experts=moe.num_experts, n_shared_experts=moe.num_shared_experts, num_experts_per_tok=moe.top_k,
        n_group=moe.n_group, topk_group=moe.topk_group, routed_scaling_factor=moe.routed_scaling_factor,
        norm_topk_prob=True, rms_norm_eps=args.norm_eps, max_position_embeddings=args.max_seq_len,
        tie_word_embeddings=False, rope_parameters={
            "rope_type": "yarn", "rope_theta": args.rope_theta, "factor": yarn.factor,
            "original_max_position_embeddings": yarn.original_max_position_embeddings, "beta_fast": yarn.beta_fast,
            "beta_slow": yarn.beta_slow, "mscale": yarn.mscale, "mscale_all_dim": yarn.mscale_all_dim})
    torch.manual_seed(2)
    hf_model = transformers.DeepseekV3ForCausalLM(config)
    spread_transformers_weights(hf_model)
    hf_model.save_pretrained(tmp_path)
    mtp_layer = f"model.layers.{args.n_layers}"
    mtp_tensors = {f"{mtp_layer}.eh_proj.weight": torch.randn(args.dim, 2 * args.dim),
                   f"{mtp_layer}.enorm.weight": torch.ones(args.dim)}
    save_file(mtp_tensors, tmp_path / "model-mtp.safetensors")
    weight_map = {name: "model.safetensors" for name in read_safetensors(tmp_path) if name not in mtp_tensors}
    weight_map.update({name: "model-mtp.safetensors" for name in mtp_tensors})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    fresh = Transformer(args)
    torch.manual_seed(0)  # read_hf_weights inits what the folder lacks under seed 0
    init_weights(fresh)
    model = build_for_comparison(args, seed=3, routing_bias=True)
    model.load_state_dict(read_hf_weights(tmp_path, args))
    messages = [record.getMessage() for record in titan_records]
    assert any(f"holds {HUB_ROWS} vocabulary rows" in message for message in messages)
    assert any(f"layers [{args.n_layers}]" in message and "skips them" in message for message in messages)
    tokens = sample_tokens()
    with torch.no_grad():
        torch.testing.assert_close(model.user_logits(tokens), hf_model.eval()(tokens).logits[..., :VOCAB],
                                   **LOGITS_TOLERANCE)
    for name, tensor in fresh.mtp.state_dict().items():  # the MTP modules: not in the folder, as initialised
        assert torch.equal(model.mtp.state_dict()[name], tensor), name


def test_softmax_routed_flavor_has_no_transformers_class(tmp_path: Path) -> None:
    args = dataclasses.replace(DEEPSEEK_V3_FLAVORS["16B"], vocab_size=VOCAB)
    with pytest.raises(ConfigError, match="routes by softmax"):
        hf_names(args)


# DeepSeek-V3's release, at the debug flavor's sizes: its wkv_a has 144 rows (the latent rank 128 plus the rotary
# key's 16), so the last row block of its scales covers 16 rows, as the release's 576-row kv_a_proj_with_mqa does.
FP8_ARGS = dataclasses.replace(DEEPSEEK_V3_FLAVORS["debugmodel"], vocab_size=VOCAB)
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}


def release_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 weight, fp32 weight_scale_inv) as DeepSeek's release stores a weight: one scale per 128 x 128 block of
    the zero-padded weight, amax / 448 (its inference code's dequantization multiplies by it)."""
    rows, columns = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, -columns % 128, 0, -rows % 128))
    blocks = padded.unflatten(1, (-1, 128)).unflatten(0, (-1, 128))  # (row blocks, 128, column blocks, 128)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448
    data = (blocks / scale_inv[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return data.flatten(2).flatten(0, 1)[:rows, :columns].contiguous(), scale_inv


def fp8_release_folder(folder: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Titan's export of `model`, rewritten as deepseek-ai/DeepSeek-V3 stores its weights: every projection of the
    decoder layers (attention, dense and shared MLPs, each routed expert) in E4M3 with its weight_scale_inv; the
    embedding, output, norms and routers as they were; config.json with the release's quantization_config. Returns
    each FP8 weight as transformers dequantizes it (integrations/finegrained_fp8.py), by HF name."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    save_hf(model.state_dict(), folder, FP8_ARGS, torch.float32, TOKENIZER)
    tensors = read_safetensors(folder)
    dequantized = {}
    for name in [name for name in tensors if name.endswith(("proj.weight", "_mqa.weight")) and ".layers." in name]:
        data, scale_inv = release_fp8(tensors[name])
        tensors[name], tensors[f"{name}_scale_inv"] = data, scale_inv
        dequantized[name] = _dequantize_fp8_weight(data, scale_inv, [128, 128], torch.float32)
    for path in folder.glob("*.safetensors"):
        path.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = FP8_QUANTIZATION
    (folder / "config.json").write_text(json.dumps(config))
    return dequantized


@pytest.fixture(scope="module")
def fp8_release(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path, dict[str, torch.Tensor]]:
    """(the bf16-era Titan model, its FP8 release folder, transformers' dequantization of each FP8 weight)."""
    folder = tmp_path_factory.mktemp("fp8_release")
    model = build_for_comparison(FP8_ARGS, seed=1, routing_bias=True)
    return model, folder, fp8_release_folder(folder, model)


def test_fp8_release_imports_as_transformers_dequantizes_it(
        fp8_release: tuple[torch.nn.Module, Path, dict[str, torch.Tensor]],
        titan_records: list[logging.LogRecord]) -> None:
    """Every FP8 weight imports as transformers' own dequantization of it, bit for bit (the experts' too, which a
    transform splits), within the format's rounding of the weights it was made from (half an E4M3 step of its
    block's amax); the other tensors are read as stored."""
    model, folder, dequantized = fp8_release
    state_dict = read_hf_weights(folder, FP8_ARGS)
    assert any(f"holds {len(dequantized)} blockwise FP8 weights (E4M3, 128 x 128 blocks)" in record.getMessage()
               for record in titan_records)
    names = dict(zip(hf_names(FP8_ARGS), (fqn for transform in export_transforms(FP8_ARGS)
                                           for fqn in [transform.fqn] * (getattr(transform, "num_experts", 1)))))
    original = model.state_dict()
    for hf_name, want in dequantized.items():
        fqn = names[hf_name]
        got, source = state_dict[fqn], original[fqn]
        if got.dim() == 3:  # a stack of experts: the HF name's expert
            expert = int(hf_name.split(".experts.")[1].split(".")[0])
            got, source = got[expert], source[expert]
        assert torch.equal(got, want), hf_name
        assert (got - source).abs().max() <= source.abs().max() * 2**-4, hf_name
    assert torch.equal(state_dict["layers.1.moe.router.gate.weight"], original["layers.1.moe.router.gate.weight"])
    # The dense block's attention and MLP, then each MoE block's attention, shared experts and 8 experts.
    assert len(dequantized) == 4 + 3 + 2 * (4 + 3 + 8 * 3)
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in dequantized


@pytest.mark.parametrize("first, size", [((72, 40), (72, 160)), ((0, 0), (144, 256)), ((130, 250), (14, 6))],
                         ids=["half-block-rows", "whole", "corner"])
def test_fp8_chunks_cut_inside_blocks_read_their_own_values(
        fp8_release: tuple[torch.nn.Module, Path, dict[str, torch.Tensor]], first: tuple[int, int],
        size: tuple[int, int]) -> None:
    """A shard's chunk of the 144-row wkv_a whose rows and columns start and end inside the 128 x 128 blocks (FSDP
    over 2 ranks cuts its rows at 72) reads its E4M3 box and the scales of the blocks it touches, and takes exactly
    its own values of the dequantized weight, as a rank of a sharded import does."""
    _, folder, dequantized = fp8_release
    inspected = inspect_folder(folder, FP8_ARGS)
    stored = read_safetensors(folder)
    fqn, hf_name = "layers.0.attention.wkv_a.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    transform = next(t for t in inspected.transforms if isinstance(t, Same) and t.fqn == fqn)
    local = torch.full(size, float("nan"))
    for step in load_steps(transform, fqn, (local, first), VOCAB):
        step = dequantized_step(step, inspected.fp8, local.dtype)
        step.place([stored[box.name][tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))]
                    for box in step.boxes])
    assert torch.equal(local, dequantized[hf_name][first[0]:first[0] + size[0], first[1]:first[1] + size[1]])


@pytest.mark.parametrize("case, message", [
    ("no-scale", r"1 FP8 weights without their scales: \['model\.layers\.0\.self_attn\.q_proj\.weight'\]"),
    ("wrong-grid", r"scale model\.layers\.0\.self_attn\.q_proj\.weight_scale_inv has shape \[2, 1\], where "
                   r"weight_block_size \[128, 128\] and the weight's \[384, 256\] give \[3, 2\]"),
    ("no-block-size", r"quantization_config has weight_block_size None"),
    ("e5m2", r"quantization_config has fmt 'e5m2'"),
    ("no-config", r"holds blockwise FP8 scales .* but its config\.json has no quantization_config"),
])
def test_bad_fp8_release_folders_name_what_is_wrong(fp8_release: tuple[torch.nn.Module, Path, dict[str, torch.Tensor]],
                                                   tmp_path: Path, case: str, message: str) -> None:
    _, source, _ = fp8_release
    folder = tmp_path / case
    shutil.copytree(source, folder)
    tensors, config = read_safetensors(folder), json.loads((folder / "config.json").read_text())
    scale = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    if case == "no-scale":
        del tensors[scale]
    elif case == "wrong-grid":
        tensors[scale] = torch.ones(2, 1)
    elif case == "no-block-size":
        del config["quantization_config"]["weight_block_size"]
    elif case == "e5m2":
        config["quantization_config"]["fmt"] = "e5m2"
    else:
        del config["quantization_config"]
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        read_hf_weights(folder, FP8_ARGS)
