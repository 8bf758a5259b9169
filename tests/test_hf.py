"""Hugging Face interop: the safetensors format, Titan <-> LlamaForCausalLM weights (names, RoPE layout, vocab
padding, config.json), reading DCP step folders on one process, and the convert/generate scripts end to end."""

import dataclasses
import importlib
import itertools
import json
import os
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan.checkpoint.dcp import read_model_weights
from titan.checkpoint.hf import (
    check_hf_config,
    from_hf_state_dict,
    hf_config,
    interleaved_to_rotate_half,
    load_hf_weights,
    rotate_half_to_interleaved,
    to_hf_state_dict,
)
from titan.checkpoint.safetensors import (
    DTYPES,
    INDEX_FILE,
    SINGLE_FILE,
    load_file,
    load_file_with_metadata,
    load_folder,
    save_file,
    save_folder,
)
from titan.config.errors import ConfigError
from titan.data.tokenizer import build_tokenizer
from titan.models.llama.args import LLAMA3_FLAVORS, ModelArgs, RopeScaling
from titan.models.llama.init import init_weights
from titan.models.llama.model import (
    Attention,
    Transformer,
    apply_rotary_emb,
    precompute_rope_cache,
)

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 2256  # the shipped tokenizer's odd size: padded to 2304, so the padding rows are exercised
DEBUG = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=VOCAB)
TOKENIZER = build_tokenizer("tokenizers/titan_2256.tiktoken")
# RoPE scaling that bites within a few dozen positions, so a wrong rope_scaling export shows in the logits.
SHORT_CONTEXT_SCALING = RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=64)


def build(args: ModelArgs, seed: int = 0) -> Transformer:
    """Build on meta, materialise on CPU and init, as the trainer does."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        init_weights(model, buffer_device="cpu")
    return model


@pytest.fixture(scope="module")
def debug_model() -> Transformer:
    return build(DEBUG)


def with_zero_padding(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """`state_dict` with the padding rows of the embedding and output zeroed, as an HF import leaves them."""
    padded = dict(state_dict)
    for fqn in ("tok_embeddings.weight", "output.weight"):
        padded[fqn] = state_dict[fqn].clone()
        padded[fqn][args.vocab_size:] = 0
    return padded


def write_hf_folder(model: Transformer, folder: Path, max_shard_bytes: int = 10**9) -> None:
    """Export `model` to `folder` as convert_to_hf.py does, in float32."""
    save_folder(to_hf_state_dict(model.state_dict(), model.args), folder, max_shard_bytes)
    config = hf_config(model.args, torch.float32, bos_token_id=TOKENIZER.bos_id, eos_token_id=TOKENIZER.eos_id)
    (folder / "config.json").write_text(json.dumps(config))


def save_dcp(state: dict, folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=folder, no_dist=True)


def sample_tensors() -> dict[str, torch.Tensor]:
    """One tensor per supported dtype, plus a 0-dim, an empty and a non-contiguous one."""
    torch.manual_seed(0)
    tensors = {}
    for name, dtype in DTYPES.items():
        if dtype.is_floating_point:
            tensors[name] = torch.randn(3, 5).to(dtype)
        elif dtype == torch.bool:
            tensors[name] = torch.rand(3, 5) > 0.5
        else:
            tensors[name] = torch.randint(0, 100, (3, 5), dtype=dtype)
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    tensors["transposed"] = torch.randn(4, 6).t()
    return tensors


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        # Compare bytes: float8 has no equality kernel on CPU, and bytes are what the format promises.
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def test_safetensors_round_trip_every_dtype(tmp_path: Path) -> None:
    tensors = sample_tensors()
    save_file(tensors, tmp_path / "t.safetensors", metadata={"format": "pt", "step": "20"})
    loaded, metadata = load_file_with_metadata(tmp_path / "t.safetensors")
    assert_same_tensors(loaded, tensors)
    assert metadata == {"format": "pt", "step": "20"}
    raw = (tmp_path / "t.safetensors").read_bytes()
    (header_length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_length])
    assert header_length % 8 == 0
    # Tensors sit back to back from the end of the header, each aligned to its element size.
    spans = sorted(entry["data_offsets"] for name, entry in header.items() if name != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - header_length
    assert all(end == next_begin for (_, end), (next_begin, _) in itertools.pairwise(spans))
    for name, entry in header.items():
        if name != "__metadata__":
            assert entry["data_offsets"][0] % tensors[name].element_size() == 0, name


def test_safetensors_rejects_truncated_file(tmp_path: Path) -> None:
    save_file({"w": torch.randn(64, 64)}, tmp_path / "t.safetensors")
    raw = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(raw[:-100])
    with pytest.raises(ConfigError, match="truncated"):
        load_file(tmp_path / "t.safetensors")


def test_save_folder_single_file_and_shards(tmp_path: Path) -> None:
    tensors = {f"layers.{i}.w": torch.randn(16, 16) for i in range(5)}  # 1 KiB each
    assert save_folder(tensors, tmp_path / "one", max_shard_bytes=10**6) == [tmp_path / "one" / SINGLE_FILE]
    assert_same_tensors(load_folder(tmp_path / "one"), tensors)

    files = save_folder(tensors, tmp_path / "sharded", max_shard_bytes=2048)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [INDEX_FILE]
    index = json.loads((tmp_path / "sharded" / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 5 * 16 * 16 * 4
    assert index["weight_map"]["layers.4.w"] == "model-00003-of-00003.safetensors"
    assert_same_tensors(load_folder(tmp_path / "sharded"), tensors)

    (tmp_path / "sharded" / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ConfigError, match="model-00002-of-00003.safetensors"):
        load_folder(tmp_path / "sharded")
    with pytest.raises(ConfigError, match="neither model.safetensors nor"):
        load_folder(tmp_path)


def test_safetensors_package_reads_ours_and_we_read_its(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = {name: t.contiguous() for name, t in sample_tensors().items()}
    save_file(tensors, tmp_path / "ours.safetensors", metadata={"format": "pt"})
    assert_same_tensors(safetensors_torch.load_file(tmp_path / "ours.safetensors"), tensors)

    safetensors_torch.save_file(tensors, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    loaded, metadata = load_file_with_metadata(tmp_path / "theirs.safetensors")
    assert_same_tensors(loaded, tensors)
    assert metadata == {"format": "pt"}

    # Same tensor order and header layout: a one-dtype checkpoint comes out byte for byte the same.
    weights = {name: torch.randn(8, 4).to(torch.bfloat16) for name in ("b", "a", "c")}
    save_file(weights, tmp_path / "ours_bf16.safetensors", metadata={"format": "pt"})
    safetensors_torch.save_file(weights, tmp_path / "theirs_bf16.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "ours_bf16.safetensors").read_bytes() == (tmp_path / "theirs_bf16.safetensors").read_bytes()


def test_titan_hf_titan_round_trip_is_exact(debug_model: Transformer) -> None:
    state_dict = debug_model.state_dict()
    hf = to_hf_state_dict(state_dict, DEBUG)
    assert len(hf) == len(state_dict) == 3 + 9 * DEBUG.n_layers
    assert hf["model.embed_tokens.weight"].shape == hf["lm_head.weight"].shape == (VOCAB, DEBUG.dim)
    assert torch.equal(hf["model.layers.3.mlp.gate_proj.weight"], state_dict["layers.3.feed_forward.w1.weight"])
    assert torch.equal(hf["model.layers.3.mlp.up_proj.weight"], state_dict["layers.3.feed_forward.w3.weight"])
    assert torch.equal(hf["model.layers.3.mlp.down_proj.weight"], state_dict["layers.3.feed_forward.w2.weight"])
    assert torch.equal(hf["model.layers.0.self_attn.v_proj.weight"], state_dict["layers.0.attention.wv.weight"])
    assert not torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], state_dict["layers.0.attention.wq.weight"])

    back = from_hf_state_dict(hf, DEBUG)
    assert list(back) == list(state_dict)
    expected = with_zero_padding(state_dict, DEBUG)
    for fqn, tensor in expected.items():
        assert torch.equal(back[fqn], tensor), fqn


def test_rope_permutation_gives_hf_rotate_half_the_same_scores() -> None:
    """Titan's interleaved-pair RoPE on Titan weights vs HF's rotate-half RoPE, written here from its formula
    (q cos + rotate_half(q) sin with the angles repeated over both halves), on the exported weights."""
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=32,
                     rope_scaling=SHORT_CONTEXT_SCALING)
    head_dim, seq = args.dim // args.n_heads, 24
    torch.manual_seed(0)
    attention = Attention(args)
    x = torch.randn(1, seq, args.dim)
    rope_cache = precompute_rope_cache(args)  # (max_seq_len, head_dim // 2, 2): cos and sin of position * freq

    def rotate_half_rope(t: torch.Tensor) -> torch.Tensor:
        cos = rope_cache[..., 0].repeat(1, 2)[:seq, None, :]  # (seq, 1, head_dim): the angles over both halves
        sin = rope_cache[..., 1].repeat(1, 2)[:seq, None, :]  # (seq, 1, head_dim)
        rotated = torch.cat([-t[..., head_dim // 2:], t[..., : head_dim // 2]], dim=-1)
        return t * cos + rotated * sin

    def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        k = k.repeat_interleave(args.n_heads // args.n_kv_heads, dim=2)  # query head h reads kv head h // n_rep
        return torch.einsum("bqhd,bkhd->bhqk", q, k)

    titan_q = apply_rotary_emb(attention.wq(x).view(1, seq, args.n_heads, head_dim), rope_cache)
    titan_k = apply_rotary_emb(attention.wk(x).view(1, seq, args.n_kv_heads, head_dim), rope_cache)
    hf_wq = interleaved_to_rotate_half(attention.wq.weight, args.n_heads)
    hf_wk = interleaved_to_rotate_half(attention.wk.weight, args.n_kv_heads)
    hf_q = rotate_half_rope((x @ hf_wq.T).view(1, seq, args.n_heads, head_dim))
    hf_k = rotate_half_rope((x @ hf_wk.T).view(1, seq, args.n_kv_heads, head_dim))
    torch.testing.assert_close(scores(hf_q, hf_k), scores(titan_q, titan_k), rtol=1e-5, atol=1e-5)
    # HF channel i is Titan channel 2i, and HF channel i + head_dim/2 is Titan channel 2i + 1.
    titan_order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    torch.testing.assert_close(hf_q, titan_q[..., titan_order], rtol=1e-5, atol=1e-5)

    # The check has teeth: unpermuted weights in the rotate-half formula give other scores.
    unpermuted_q = rotate_half_rope(attention.wq(x).view(1, seq, args.n_heads, head_dim))
    unpermuted_k = rotate_half_rope(attention.wk(x).view(1, seq, args.n_kv_heads, head_dim))
    assert not torch.allclose(scores(unpermuted_q, unpermuted_k), scores(titan_q, titan_k), atol=1e-3)
    assert torch.equal(rotate_half_to_interleaved(hf_wq, args.n_heads), attention.wq.weight)


def test_from_hf_names_every_bad_tensor(debug_model: Transformer) -> None:
    hf = to_hf_state_dict(debug_model.state_dict(), DEBUG)
    del hf["model.layers.2.self_attn.k_proj.weight"]
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    hf["model.norm.weight"] = torch.ones(DEBUG.dim + 1)
    with pytest.raises(ConfigError) as error:
        from_hf_state_dict(hf, DEBUG)
    message = str(error.value)
    assert "lacks 1 tensors" in message and "model.layers.2.self_attn.k_proj.weight" in message
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" in message
    assert "model.norm.weight has shape [257], but the model needs [256]" in message


def test_load_hf_weights_checks_config(debug_model: Transformer, tmp_path: Path) -> None:
    write_hf_folder(debug_model, tmp_path)
    expected = with_zero_padding(debug_model.state_dict(), DEBUG)
    loaded = load_hf_weights(tmp_path, DEBUG)
    assert all(torch.equal(loaded[fqn], tensor) for fqn, tensor in expected.items())

    with pytest.raises(ConfigError) as error:
        load_hf_weights(tmp_path, dataclasses.replace(DEBUG, n_layers=4, rope_scaling=SHORT_CONTEXT_SCALING))
    assert "num_hidden_layers 6, but the Titan model args give 4" in str(error.value)
    assert "RoPE scaling None" in str(error.value)


def test_config_in_transformers_5_layout_is_read(tmp_path: Path) -> None:
    args = dataclasses.replace(DEBUG, rope_scaling=SHORT_CONTEXT_SCALING)
    config = hf_config(args, torch.bfloat16, bos_token_id=1, eos_token_id=2)
    parameters = {"rope_theta": config.pop("rope_theta"), **config.pop("rope_scaling")}
    check_hf_config({**config, "rope_parameters": parameters}, args, tmp_path / "config.json")
    with pytest.raises(ConfigError, match="rope_theta 10000.0"):
        check_hf_config({**config, "rope_parameters": {**parameters, "rope_theta": 10000.0}}, args, tmp_path)


def test_tied_checkpoint_fills_the_output_layer(debug_model: Transformer, tmp_path: Path) -> None:
    """Meta's Llama 3.2 1B/3B ship tie_word_embeddings and no lm_head tensor."""
    hf = to_hf_state_dict(debug_model.state_dict(), DEBUG)
    del hf["lm_head.weight"]
    save_folder(hf, tmp_path, max_shard_bytes=10**9)
    config = {**hf_config(DEBUG, torch.float32, bos_token_id=1, eos_token_id=2), "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_hf_weights(tmp_path, DEBUG)
    assert torch.equal(loaded["output.weight"], loaded["tok_embeddings.weight"])


@pytest.mark.parametrize("rope_scaling", [None, SHORT_CONTEXT_SCALING], ids=["plain_rope", "llama3_scaling"])
def test_transformers_logits_match(rope_scaling: RopeScaling | None, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = dataclasses.replace(DEBUG, rope_scaling=rope_scaling, max_seq_len=128)
    model = build(args, seed=1)
    write_hf_folder(model, tmp_path, max_shard_bytes=4 * 10**6)  # sharded, to load through the index too
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf_model.dtype == torch.float32
    tokens = torch.randint(0, VOCAB, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_logits = hf_model(tokens).logits
        titan_logits = model.user_logits(tokens)
    # fp32 throughout; the two differ only in op order (RoPE in complex vs real arithmetic, SDPA vs eager).
    torch.testing.assert_close(hf_logits, titan_logits, rtol=0, atol=1e-4)


def test_read_model_weights_reads_only_the_model(debug_model: Transformer, tmp_path: Path) -> None:
    state_dict = debug_model.state_dict()
    save_dcp({"model": state_dict, "optimizer": {"state": {"exp_avg": torch.ones(3)}}, "train_state": {"step": 20}},
             tmp_path / "step-20")
    loaded = read_model_weights(tmp_path / "step-20")
    assert sorted(loaded) == sorted(state_dict)
    assert all(torch.equal(loaded[fqn], tensor) for fqn, tensor in state_dict.items())

    with pytest.raises(ConfigError, match="step-21 does not exist"):
        read_model_weights(tmp_path / "step-21")
    (tmp_path / "not_a_checkpoint").mkdir()
    with pytest.raises(ConfigError, match="not_a_checkpoint has no readable metadata"):
        read_model_weights(tmp_path / "not_a_checkpoint")
    save_dcp({"optimizer": {"exp_avg": torch.ones(3)}}, tmp_path / "no_model")
    with pytest.raises(ConfigError, match="holds no model weights"):
        read_model_weights(tmp_path / "no_model")
    for data_file in (tmp_path / "step-20").glob("*.distcp"):
        data_file.write_bytes(data_file.read_bytes()[:1000])
    with pytest.raises(ConfigError, match="step-20 could not be read .* missing or corrupt"):
        read_model_weights(tmp_path / "step-20")


def start_script(name: str, *args: str) -> subprocess.Popen:
    """Start scripts/<name> from the repo root; the tests start independent runs together to save time."""
    # One thread each: two or three runs share the CPU cores.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen) -> tuple[int, str, str]:
    stdout, stderr = process.communicate(timeout=300)
    return process.returncode, stdout, stderr


def test_convert_scripts(debug_model: Transformer, tmp_path: Path) -> None:
    """Both scripts (and a user mistake) at once, each from a folder written here."""
    state_dict = debug_model.state_dict()
    save_dcp({"model": state_dict, "optimizer": {"exp_avg": torch.ones(3)}}, tmp_path / "step-1")
    write_hf_folder(debug_model, tmp_path / "hf_in")
    flags = ("--", "--model.flavor", "debugmodel")
    export = start_script("convert_to_hf.py", str(tmp_path / "step-1"), str(tmp_path / "hf"), "--max_shard_bytes",
                          "4000000", *flags)
    to_titan = start_script("convert_from_hf.py", str(tmp_path / "hf_in"), str(tmp_path / "dcp"), *flags)
    missing = start_script("convert_to_hf.py", str(tmp_path / "step-2"), str(tmp_path / "hf2"), *flags)
    for process in (export, to_titan):
        code, stdout, stderr = finish(process)
        assert code == 0, stdout + stderr
    code, stdout, stderr = finish(missing)
    assert code == 2 and "step-2 does not exist" in stdout and "Traceback" not in stderr

    # Export: bfloat16 by default, sharded, with the config of the debug flavor and the tokenizer.
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["intermediate_size"] == 768 and config["torch_dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"]) == (TOKENIZER.bos_id, TOKENIZER.eos_id)
    assert (tmp_path / "hf" / INDEX_FILE).is_file()
    expected_hf = {name: tensor.to(torch.bfloat16) for name, tensor in to_hf_state_dict(state_dict, DEBUG).items()}
    assert_same_tensors(load_folder(tmp_path / "hf"), expected_hf)

    # Import: a float32 DCP folder holding exactly the weights, with zero padding rows.
    imported = read_model_weights(tmp_path / "dcp")
    assert_same_tensors(imported, with_zero_padding(state_dict, DEBUG))


def greedy_text(model: Transformer, prompt: str, max_new_tokens: int) -> str:
    """Greedy continuation computed directly from user_logits, to check generate.py against."""
    ids = TOKENIZER.encode(prompt, bos=True, eos=False)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            next_id = int(model.user_logits(torch.tensor([ids]))[0, -1].argmax())
            if next_id == TOKENIZER.eos_id:
                break
            ids.append(next_id)
    return TOKENIZER.decode(ids[1:])


def test_generate_script(debug_model: Transformer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_dcp({"model": debug_model.state_dict()}, tmp_path / "step-1")
    write_hf_folder(debug_model, tmp_path / "hf")
    prompt, max_new_tokens, temperature, top_k, seed = "def main(", 12, 0.9, 50, 3
    sampled_run = start_script("generate.py", str(tmp_path / "step-1"), "--prompt", prompt, "--max_new_tokens",
                               str(max_new_tokens), "--temperature", str(temperature), "--top_k", str(top_k),
                               "--seed", str(seed))
    greedy_run = start_script("generate.py", str(tmp_path / "hf"), "--hf", "--prompt", prompt, "--temperature", "0",
                              "--max_new_tokens", str(max_new_tokens))

    # The same seed in this process must give the same sample as the script's run.
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    generate_script = importlib.import_module("generate")
    prompt_ids = TOKENIZER.encode(prompt, bos=True, eos=False)
    args = dataclasses.replace(DEBUG, max_seq_len=len(prompt_ids) + max_new_tokens)
    model = generate_script.build_model(args, debug_model.state_dict(), torch.device("cpu"))
    new_ids = generate_script.generate(model, prompt_ids, max_new_tokens, temperature, top_k, TOKENIZER.eos_id,
                                       torch.Generator().manual_seed(seed))
    expected_sample = TOKENIZER.decode(prompt_ids[1:] + new_ids)

    (sampled_code, sampled, sampled_err), (greedy_code, greedy, greedy_err) = finish(sampled_run), finish(greedy_run)
    assert sampled_code == greedy_code == 0, sampled_err + greedy_err
    assert len(new_ids) > 0 and sampled.rstrip("\n") == expected_sample
    assert greedy.rstrip("\n") == greedy_text(debug_model, prompt, max_new_tokens)
