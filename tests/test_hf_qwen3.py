"""Hugging Face interop for Qwen3 (titan/checkpoint/hf.py, hf_io.py): Titan's dense, tied and mixture-of-experts
Qwen3 against transformers' Qwen3ForCausalLM and Qwen3MoeForCausalLM on the same weights, both ways; the exact
layout of an export (per-expert tensors, permuted QK-norms, no tied output, no routing bias); the hub's padded vocab;
sharded load and save on two gloo ranks; config and shape errors. (Qwen-format tokenizer.json files:
tests/test_tokenizer_json.py.)"""

import dataclasses
import importlib
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from titan.checkpoint.dcp import read_model_weights
from titan.checkpoint.hf import HF_CONFIG_FILE, hf_names, rotate_half_rows
from titan.checkpoint.hf_io import load_hf, read_hf_weights, save_hf
from titan.config.errors import ConfigError
from titan.models.common.family import BuildOptions
from titan.models.common.moe import MoEArgs
from titan.models.families import FAMILIES
from titan.models.qwen3 import Qwen3Args
from titan.parallel.dims import destroy_distributed

from harness.hf_models import (
    TOKENIZER,
    VOCAB,
    assert_same_tensors,
    finish,
    read_safetensors,
    sample_tokens,
    save_dcp,
    spread_transformers_weights,
    start_script,
    transformers_model,
)
from harness.models import build_for_comparison
from harness.torchrun import spawn_ranks

ROOT = Path(__file__).resolve().parents[1]
# head_dim 32, not dim / n_heads = 16, as in every published Qwen3 (128 apart from dim).
DENSE = Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=96, vocab_size=VOCAB,
                  max_seq_len=64)
TIED = dataclasses.replace(DENSE, tie_embeddings=True)
MOE = dataclasses.replace(DENSE, moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=48))
# Auxiliary-loss-free balancing: each MoE layer holds a routing bias (expert_bias), which HF has no tensor for.
BALANCED_MOE = dataclasses.replace(DENSE, moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=48, load_balance_coeff=1e-3))
FLAVORS = {"dense": DENSE, "tied": TIED, "moe": MOE}
HF_CLASSES = {"dense": "Qwen3ForCausalLM", "tied": "Qwen3ForCausalLM", "moe": "Qwen3MoeForCausalLM"}
# Rows of a hub checkpoint's embedding, past the tokenizer's VOCAB, as Qwen's 151936 rows for 151669 tokens.
HUB_ROWS = 2304
SMALL_SHARD_BYTES = 2 * 10**5  # a few files per export, so the index and several shards are exercised
# fp32 on both sides; the models differ only in op order (RoPE on pairs vs halves, SDPA vs eager attention, the
# experts' grouped matmul vs one matmul per expert). Measured: about 2e-6 on logits of magnitude up to 10.
LOGITS_TOLERANCE = {"rtol": 0.0, "atol": 1e-5}


def as_imported(state_dict: dict[str, torch.Tensor], args: Qwen3Args) -> dict[str, torch.Tensor]:
    """`state_dict` as an HF import leaves it: vocab padding rows and routing biases zero."""
    imported = {fqn: tensor.clone() for fqn, tensor in state_dict.items()}
    for fqn, tensor in imported.items():
        if fqn in ("tok_embeddings.weight", "output.weight"):
            tensor[args.vocab_size:] = 0
        elif fqn.endswith("expert_bias"):
            tensor.zero_()
    return imported


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The MoE model as a float32 folder in several files. Read-only: tests that change it copy it."""
    folder = tmp_path_factory.mktemp("moe")
    save_hf(build_for_comparison(MOE, seed=0).state_dict(), folder, MOE, torch.float32, TOKENIZER, SMALL_SHARD_BYTES)
    return folder


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_export_loads_in_transformers(flavor: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = FLAVORS[flavor]
    model = build_for_comparison(args, seed=1)
    save_hf(model.state_dict(), tmp_path, args, torch.float32, TOKENIZER, SMALL_SHARD_BYTES)
    hf_model = transformers_model(tmp_path)
    assert type(hf_model).__name__ == HF_CLASSES[flavor]
    tokens = sample_tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, model.user_logits(tokens), **LOGITS_TOLERANCE)


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_transformers_folder_imports(flavor: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     titan_records: list[logging.LogRecord]) -> None:
    """A folder written by transformers' save_pretrained (per-expert tensors, num_local_experts, rope_parameters),
    with the hub's extra vocab rows past the tokenizer, read into Titan."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = FLAVORS[flavor]
    shape = dict(vocab_size=HUB_ROWS, hidden_size=args.dim, num_hidden_layers=args.n_layers,
                 num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim,
                 intermediate_size=args.hidden_dim, rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta,
                 max_position_embeddings=args.max_seq_len, tie_word_embeddings=args.tie_embeddings)
    torch.manual_seed(2)
    if args.moe is None:
        hf_model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape))
    else:
        hf_model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **shape, num_experts=args.moe.num_experts, num_experts_per_tok=args.moe.top_k,
            moe_intermediate_size=args.moe.hidden_dim, norm_topk_prob=True))
    spread_transformers_weights(hf_model)
    hf_model.save_pretrained(tmp_path)

    model = build_for_comparison(args, seed=3)
    model.load_state_dict(read_hf_weights(tmp_path, args))
    assert any(f"holds {HUB_ROWS} vocabulary rows" in record.getMessage() for record in titan_records)
    tokens = sample_tokens()
    with torch.no_grad():
        torch.testing.assert_close(model.user_logits(tokens), hf_model.eval()(tokens).logits[..., :VOCAB],
                                   **LOGITS_TOLERANCE)
        assert not model.output.weight[VOCAB:].any()  # Titan's padding rows stay zero


@pytest.mark.parametrize("args", [BALANCED_MOE, TIED], ids=["moe_with_expert_bias", "tied"])
def test_export_layout_and_round_trip_are_exact(args: Qwen3Args, tmp_path: Path) -> None:
    model = build_for_comparison(args, seed=4)
    with torch.no_grad():
        for layer in model.layers.values():
            if args.moe is not None:
                layer.moe.router.expert_bias.normal_()  # nonzero, to see that export leaves it out
    state_dict = model.state_dict()
    save_hf(state_dict, tmp_path, args, torch.float32, TOKENIZER, SMALL_SHARD_BYTES)
    hf = read_safetensors(tmp_path)
    assert sorted(hf) == sorted(hf_names(args))
    assert not any("bias" in name for name in hf)
    assert ("lm_head.weight" in hf) != args.tie_embeddings
    assert hf["model.embed_tokens.weight"].shape == (VOCAB, args.dim)
    config = json.loads((tmp_path / HF_CONFIG_FILE).read_text())
    assert (config["vocab_size"], config["head_dim"], config["tie_word_embeddings"]) == (VOCAB, 32,
                                                                                         args.tie_embeddings)

    # Within each head HF channel i is Titan channel 2i, and HF channel 16 + i Titan's 2i + 1: wq's rows, q_norm's.
    hf_row_of = rotate_half_rows(torch.arange(args.n_heads * args.head_dim), args.head_dim)
    for titan, hf_name in [("attention.wq.weight", "self_attn.q_proj.weight"),
                           ("attention.q_norm.weight", "self_attn.q_norm.weight")]:
        titan_tensor = state_dict[f"layers.1.{titan}"]
        assert torch.equal(hf[f"model.layers.1.{hf_name}"][hf_row_of[:len(titan_tensor)]], titan_tensor)
    if args.moe is not None:
        assert config["num_experts"] == 4 and config["moe_intermediate_size"] == 48
        for expert in range(args.moe.num_experts):
            for titan, hf_name in [("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")]:
                assert torch.equal(hf[f"model.layers.1.mlp.experts.{expert}.{hf_name}.weight"],
                                   state_dict[f"layers.1.moe.experts.{titan}"][expert])
        assert torch.equal(hf["model.layers.0.mlp.gate.weight"], state_dict["layers.0.moe.router.gate.weight"])

    assert_same_tensors(read_hf_weights(tmp_path, args), as_imported(state_dict, args))


# ---- errors: each names the config.json field, or the tensor, and a fix ----

def drop_config(folder: Path) -> None:
    (folder / HF_CONFIG_FILE).unlink()


MISMATCHES = {
    "head_dim": (dataclasses.replace(MOE, head_dim=16), None, "head_dim 32, but the Titan model args give 16"),
    "num_experts": (dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, num_experts=8)), None,
                    "num_experts 4, but the Titan model args give 8"),
    "expert_hidden": (dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, hidden_dim=64)), None,
                      "moe_intermediate_size 48, but the Titan model args give 64"),
    "tokenizer_larger_than_folder": (dataclasses.replace(MOE, vocab_size=VOCAB + 1), None,
                                     f"vocab_size {VOCAB}, but the Titan model args give at least {VOCAB + 1}"),
    "tied_args": (dataclasses.replace(MOE, tie_embeddings=True), None,
                  "tie_word_embeddings False, but the Titan model args give True"),
    "dense_args": (DENSE, None, "not a Qwen3 (Qwen3ForCausalLM)"),
    "no_config": (dataclasses.replace(MOE, head_dim=16), drop_config,
                  "q_norm.weight in model-00002-of-00005.safetensors has shape [32], but the model needs [16]"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatched_folder_names_the_field(case: str, moe_folder: Path, tmp_path: Path) -> None:
    args, damage, expected = MISMATCHES[case]
    folder = moe_folder
    if damage is not None:
        folder = tmp_path / "hf"
        folder.mkdir()
        for path in moe_folder.iterdir():
            (folder / path.name).write_bytes(path.read_bytes())
        damage(folder)
    with pytest.raises(ConfigError) as error:
        read_hf_weights(folder, args)
    message = str(error.value)
    assert expected in message and "--model.flavor" in message, message


# ---- sharded: two gloo ranks, each reading and writing only its own rows ----

def shard_placements(fqn: str, tensor: torch.Tensor) -> list[Shard]:
    """FSDP's dim-0 shards for most tensors (q_norm's 32 rows split mid-head, the experts 2 per rank); the experts'
    w2 and w3 split along their rows and columns instead, as TP or FSDP next to expert parallel split them."""
    if fqn.endswith("experts.w2"):
        return [Shard(1)]
    if fqn.endswith("experts.w3"):
        return [Shard(2)]
    return [Shard(0)]


def check_sharded_on_rank(rank: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    args, root = BALANCED_MOE, Path(folder)
    full = read_hf_weights(root / "single", args)
    # NaN wherever the folder has the rows; the routing bias, which it lacks, keeps what the model holds (init's 0).
    sharded = {fqn: distribute_tensor(tensor.clone() if fqn.endswith("expert_bias") else
                                      torch.full_like(tensor, float("nan")), mesh, shard_placements(fqn, tensor))
               for fqn, tensor in full.items()}
    load_hf(root / "single", sharded, args)
    for fqn, tensor in sharded.items():
        assert isinstance(tensor, DTensor) and torch.equal(tensor.full_tensor(), full[fqn]), fqn
    save_hf(sharded, root / "sharded", args, torch.float32, TOKENIZER, SMALL_SHARD_BYTES)
    destroy_distributed(wait_for_peers=True)


def test_sharded_load_and_save_match_one_process(tmp_path: Path) -> None:
    save_hf(build_for_comparison(BALANCED_MOE, seed=5).state_dict(), tmp_path / "single", BALANCED_MOE, torch.float32,
            TOKENIZER, SMALL_SHARD_BYTES)
    spawn_ranks(check_sharded_on_rank, 2, str(tmp_path))
    assert_same_tensors(read_safetensors(tmp_path / "sharded"), read_safetensors(tmp_path / "single"))
    assert ((tmp_path / "sharded" / HF_CONFIG_FILE).read_text() == (tmp_path / "single" / HF_CONFIG_FILE).read_text())


# ---- the scripts ----

def test_scripts_with_model_name_qwen3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """convert_to_hf.py and convert_from_hf.py (at once, each from a folder written here), and generate.py's model on
    an import, for the MoE debug flavor trained with the default --moe.load_balance_coeff: the checkpoint holds
    routing biases, which HF has no tensor for."""
    args = FAMILIES["qwen3"].build_args("debugmodel_moe", BuildOptions(
        vocab_size=VOCAB, vocab_size_multiple_of=64, max_seq_len=64, moe_load_balance_coeff=1e-3))
    model = build_for_comparison(args, seed=6)
    state_dict = model.state_dict()
    save_dcp({"model": state_dict}, tmp_path / "step-1")
    save_hf(state_dict, tmp_path / "reference", args, torch.float32, TOKENIZER)
    flags = ("--", "--model.name", "qwen3", "--model.flavor", "debugmodel_moe")
    export = start_script("convert_to_hf.py", str(tmp_path / "step-1"), str(tmp_path / "hf"), "--dtype", "float32",
                          *flags)
    to_titan = start_script("convert_from_hf.py", str(tmp_path / "reference"), str(tmp_path / "dcp"), *flags)

    # generate.py's model from the imported weights samples what the trained model does (greedy: the argmax).
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    generate_script = importlib.import_module("generate")
    imported = generate_script.build_model(FAMILIES["qwen3"], args, read_hf_weights(tmp_path / "reference", args),
                                           torch.device("cpu"))
    prompt_ids = TOKENIZER.encode("def main(", bos=True, eos=False)
    new_ids = generate_script.generate(imported, prompt_ids, 4, 0.0, None, TOKENIZER.eos_id, torch.Generator())
    assert new_ids
    with torch.no_grad():
        for new_id in new_ids:
            assert new_id == int(model.user_logits(torch.tensor([prompt_ids]))[0, -1].argmax())
            prompt_ids.append(new_id)

    for process in (export, to_titan):
        code, stdout, stderr = finish(process)
        assert code == 0, stdout + stderr
    assert json.loads((tmp_path / "hf" / HF_CONFIG_FILE).read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    assert_same_tensors(read_safetensors(tmp_path / "hf"), read_safetensors(tmp_path / "reference"))
    assert_same_tensors(read_model_weights(tmp_path / "dcp"), as_imported(state_dict, args))
