"""Hugging Face interop for Llama 3 (titan/checkpoint/hf.py, hf_io.py): Titan <-> LlamaForCausalLM weights, the
exact layout of an export (names, RoPE rows, vocab padding, shards and their index) and its round trip, the output
layer of a tied checkpoint (Llama 3.2), and logits against transformers' with and without Llama 3.1 RoPE scaling.
(What every family's interop shares, on this model: tests/test_hf.py.)"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from titan.checkpoint.hf import HF_CONFIG_FILE, hf_config, rotate_half_rows
from titan.checkpoint.hf_io import INDEX_FILE, SHARDED_FOLDER, inspect_folder, read_hf_weights, save_hf
from titan.models.common.hf_mapping import VocabRows
from titan.models.common.rotary import RopeScaling
from titan.models.llama.model import Transformer

from harness.hf_models import (
    DEBUG,
    SHORT_CONTEXT_SCALING,
    SMALL_SHARD_BYTES,
    TOKENIZER,
    VOCAB,
    assert_same_tensors,
    expected_hf_tensors,
    read_safetensors,
    transformers_logits,
    with_zero_padding,
)
from harness.models import build_model


def test_titan_hf_titan_round_trip_is_exact(debug_model: Transformer, tmp_path: Path) -> None:
    state_dict = debug_model.state_dict()
    save_hf(state_dict, tmp_path, DEBUG, torch.float32, TOKENIZER, SMALL_SHARD_BYTES)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    shards = sorted(path.name for path in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert not (tmp_path / SHARDED_FOLDER).exists()  # the per-rank files are gone once consolidated

    hf = read_safetensors(tmp_path)
    assert len(hf) == len(state_dict) == 3 + 9 * DEBUG.n_layers
    assert hf["model.embed_tokens.weight"].shape == hf["lm_head.weight"].shape == (VOCAB, DEBUG.dim)
    assert torch.equal(hf["model.layers.3.mlp.gate_proj.weight"], state_dict["layers.3.feed_forward.w1.weight"])
    assert torch.equal(hf["model.layers.3.mlp.up_proj.weight"], state_dict["layers.3.feed_forward.w3.weight"])
    assert torch.equal(hf["model.layers.3.mlp.down_proj.weight"], state_dict["layers.3.feed_forward.w2.weight"])
    assert torch.equal(hf["model.layers.0.self_attn.v_proj.weight"], state_dict["layers.0.attention.wv.weight"])
    head_dim = DEBUG.dim // DEBUG.n_heads
    wq = state_dict["layers.0.attention.wq.weight"]
    assert not torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], wq)
    assert torch.equal(hf["model.layers.0.self_attn.q_proj.weight"][rotate_half_rows(torch.arange(len(wq)), head_dim)],
                       wq)
    assert_same_tensors(hf, expected_hf_tensors(state_dict, DEBUG))

    back = read_hf_weights(tmp_path, DEBUG)
    assert list(back) == list(state_dict)
    assert_same_tensors(back, with_zero_padding(state_dict, DEBUG))


def test_tied_checkpoint_fills_the_output_layer(hf_folder: Path, tmp_path: Path) -> None:
    """Meta's Llama 3.2 1B/3B ship tie_word_embeddings and no lm_head tensor, in one model.safetensors."""
    tensors = read_safetensors(hf_folder)
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = {**hf_config(DEBUG, torch.float32, bos_token_id=1, eos_token_id=2), "tie_word_embeddings": True}
    (tmp_path / HF_CONFIG_FILE).write_text(json.dumps(config))
    assert VocabRows("output.weight", "model.embed_tokens.weight") in inspect_folder(tmp_path, DEBUG).transforms
    loaded = read_hf_weights(tmp_path, DEBUG)
    assert torch.equal(loaded["output.weight"], loaded["tok_embeddings.weight"])
    assert torch.equal(loaded["output.weight"][:VOCAB], tensors["model.embed_tokens.weight"])


@pytest.mark.parametrize("rope_scaling", [None, SHORT_CONTEXT_SCALING], ids=["plain_rope", "llama3_scaling"])
def test_transformers_logits_match(rope_scaling: RopeScaling | None, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = dataclasses.replace(DEBUG, rope_scaling=rope_scaling, max_seq_len=128)
    model = build_model(args, seed=1)
    save_hf(model.state_dict(), tmp_path, args, torch.float32, TOKENIZER, SMALL_SHARD_BYTES)  # sharded, with index
    tokens = torch.randint(0, VOCAB, (2, 96), generator=torch.Generator().manual_seed(0))
    hf_logits = transformers_logits(tmp_path, tokens)
    with torch.no_grad():
        titan_logits = model.user_logits(tokens)
    # fp32 throughout; the two differ only in op order (RoPE in complex vs real arithmetic, SDPA vs eager).
    torch.testing.assert_close(hf_logits, titan_logits, rtol=0, atol=1e-4)
