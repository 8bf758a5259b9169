"""Hugging Face checkpoints on one process: what every family's interop rests on (titan/checkpoint/hf.py, hf_io.py),
on the Llama debug model. RoPE's row permutation against HF's rotate-half, a chunk's HF rows, config.json checks (in
transformers 5's layout too), DCP model reads, malformed folders named with a fix, --checkpoint.initial_load_in_hf and
--checkpoint.last_save_in_hf through train.py, and the convert and generate scripts end to end. The safetensors format
itself is the `safetensors` package's. Each family's weights against transformers': tests/test_hf_llama.py,
tests/test_hf_qwen3.py, tests/test_hf_deepseek_v3.py; multi-rank layouts: tests/test_hf_sharded.py."""

import dataclasses
import importlib
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from titan.checkpoint.dcp import read_model_weights
from titan.checkpoint.hf import HF_CONFIG_FILE, check_hf_config, hf_config, rope_row_blocks, rotate_half_rows
from titan.checkpoint.hf_io import INDEX_FILE, SHARDED_FOLDER, inspect_folder, read_hf_weights
from titan.config.errors import ConfigError
from titan.data.loader import build_dataloader
from titan.data.micro_batch import document_layout, mask_cross_document_targets
from titan.data.tokenizer import build_tokenizer
from titan.models.common.attention import Attention
from titan.models.common.hf_mapping import VocabRows
from titan.models.common.loss import cross_entropy_loss
from titan.models.common.rotary import apply_rotary_emb, precompute_rope_cache
from titan.models.families import FAMILIES
from titan.models.llama.args import ModelArgs
from titan.models.llama.model import Transformer
from titan.validate import load_job_config

from harness.hf_models import (
    DEBUG,
    SHORT_CONTEXT_SCALING,
    SMALL_SHARD_BYTES,
    TOKENIZER,
    VOCAB,
    assert_same_tensors,
    expected_hf_tensors,
    finish,
    read_safetensors,
    save_dcp,
    start_python,
    start_script,
    transformers_logits,
    with_zero_padding,
)
from harness.models import build_model
from harness.train_script import losses_by_step, metric_records

ROOT = Path(__file__).resolve().parents[1]
# The debug model on a tiny batch, fp32, a loss record every step: a train.py step takes well under a second.
TINY_RUN = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "1",
            "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32"]


def test_rope_permutation_gives_hf_rotate_half_the_same_scores() -> None:
    """Titan's interleaved-pair RoPE on Titan weights vs HF's rotate-half RoPE, written here from its formula
    (q cos + rotate_half(q) sin with the angles repeated over both halves), on weights moved to their HF rows."""
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

    def to_hf_rows(weight: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(len(weight))
        assert torch.equal(rotate_half_rows(rows, head_dim).sort().values, rows)  # a permutation of the rows
        hf_weight = torch.empty_like(weight)
        hf_weight[rotate_half_rows(rows, head_dim)] = weight
        return hf_weight

    with torch.no_grad():
        titan_q = apply_rotary_emb(attention.wq(x).view(1, seq, args.n_heads, head_dim), rope_cache)
        titan_k = apply_rotary_emb(attention.wk(x).view(1, seq, args.n_kv_heads, head_dim), rope_cache)
        hf_q = rotate_half_rope((x @ to_hf_rows(attention.wq.weight).T).view(1, seq, args.n_heads, head_dim))
        hf_k = rotate_half_rope((x @ to_hf_rows(attention.wk.weight).T).view(1, seq, args.n_kv_heads, head_dim))
        torch.testing.assert_close(scores(hf_q, hf_k), scores(titan_q, titan_k), rtol=1e-5, atol=1e-5)
        # HF channel i is Titan channel 2i, and HF channel i + head_dim/2 is Titan channel 2i + 1.
        titan_order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
        torch.testing.assert_close(hf_q, titan_q[..., titan_order], rtol=1e-5, atol=1e-5)

        # The check has teeth: unpermuted weights in the rotate-half formula give other scores.
        unpermuted_q = rotate_half_rope(attention.wq(x).view(1, seq, args.n_heads, head_dim))
        unpermuted_k = rotate_half_rope(attention.wk(x).view(1, seq, args.n_kv_heads, head_dim))
        assert not torch.allclose(scores(unpermuted_q, unpermuted_k), scores(titan_q, titan_k), atol=1e-3)


def test_rope_row_blocks_map_a_chunk_to_its_hf_rows() -> None:
    head_dim = DEBUG.dim // DEBUG.n_heads  # 16

    # Whole heads stay on their own rows, permuted within each head: never a plain slice, although the block
    # starts and ends at the chunk's ends.
    (block,) = rope_row_blocks(2 * head_dim, 2 * head_dim, head_dim)
    assert block.hf_row == 2 * head_dim and block.contiguous_start is None

    for first_row, num_rows in [(20, 40),  # from mid-head 1 to mid-head 3
                                (5, 6),  # inside one head
                                (0, DEBUG.n_kv_heads * head_dim)]:
        blocks = rope_row_blocks(first_row, num_rows, head_dim)
        assert 1 <= len(blocks) <= 3, (first_row, num_rows)
        # Applied, the blocks put every row of the chunk once, where the full permutation puts it.
        hf_row_of = rotate_half_rows(torch.arange(first_row, first_row + num_rows), head_dim)
        placed = torch.cat([block.local_rows for block in blocks])
        assert torch.equal(placed.sort().values, torch.arange(num_rows))
        for block in blocks:
            assert torch.equal(hf_row_of[block.local_rows], block.hf_row + torch.arange(len(block.local_rows)))
    assert len(rope_row_blocks(20, 40, head_dim)) == 3


def test_read_hf_weights_checks_config(debug_model: Transformer, hf_folder: Path) -> None:
    assert VocabRows("output.weight", "lm_head.weight") in inspect_folder(hf_folder, DEBUG).transforms
    with pytest.raises(ConfigError) as error:
        read_hf_weights(hf_folder, dataclasses.replace(DEBUG, n_layers=4, rope_scaling=SHORT_CONTEXT_SCALING))
    message = str(error.value)
    assert str(hf_folder / HF_CONFIG_FILE) in message
    assert "num_hidden_layers 6, but the Titan model args give 4" in message
    assert "RoPE scaling None" in message and "--model.flavor" in message


def test_config_in_transformers_5_layout_is_read(tmp_path: Path) -> None:
    args = dataclasses.replace(DEBUG, rope_scaling=SHORT_CONTEXT_SCALING)
    config = hf_config(args, torch.bfloat16, bos_token_id=1, eos_token_id=2)
    parameters = {"rope_theta": config.pop("rope_theta"), **config.pop("rope_scaling")}
    check_hf_config({**config, "rope_parameters": parameters}, args, tmp_path / HF_CONFIG_FILE)
    with pytest.raises(ConfigError, match="rope_theta 10000.0"):
        check_hf_config({**config, "rope_parameters": {**parameters, "rope_theta": 10000.0}}, args, tmp_path)


def test_read_model_weights_reads_only_the_model(debug_model: Transformer, tmp_path: Path) -> None:
    state_dict = debug_model.state_dict()
    save_dcp({"model": state_dict, "optimizer": {"state": {"exp_avg": torch.ones(3)}}, "train_state": {"step": 20}},
             tmp_path / "step-20")
    loaded = read_model_weights(tmp_path / "step-20")
    assert_same_tensors(loaded, state_dict)

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


# ---- malformed folders: each a ConfigError naming the file and a fix, before any tensor data is read ----

# A weight of layer 1, whose file holds several tensors.
KNOWN_WEIGHT = "model.layers.1.self_attn.q_proj.weight"


def shard_of(folder: Path, name: str) -> Path:
    return folder / json.loads((folder / INDEX_FILE).read_text())["weight_map"][name]


def rewrite_shard(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> str:
    """Apply `change` to the tensors of KNOWN_WEIGHT's file, rewrite it with the `safetensors` package, and return
    the file's name."""
    path = shard_of(folder, KNOWN_WEIGHT)
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return path.name


def truncate_shard(folder: Path) -> str:
    path = shard_of(folder, KNOWN_WEIGHT)
    path.write_bytes(path.read_bytes()[:-100])
    return path.name


def delete_shard(folder: Path) -> str:
    path = shard_of(folder, KNOWN_WEIGHT)
    path.unlink()
    return path.name


def overlap_offsets(folder: Path) -> str:
    """Rewrite the file's header by hand (8-byte little-endian length, JSON header, data) so that every tensor after
    the first starts 8 bytes early: the second overlaps the first, and the data ends where the header says."""
    path = shard_of(folder, KNOWN_WEIGHT)
    raw = path.read_bytes()
    (header_length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_length])
    names = sorted((name for name in header if name != "__metadata__"), key=lambda name: header[name]["data_offsets"])
    assert len(names) > 1
    for name in names[1:]:
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [begin - 8, end - 8]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header with spaces to a multiple of 8
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + header_length:-8])
    return path.name


def int_weight(folder: Path) -> str:
    return rewrite_shard(folder, lambda tensors: tensors.update({KNOWN_WEIGHT: tensors[KNOWN_WEIGHT].to(torch.int32)}))


def short_weight(folder: Path) -> str:
    return rewrite_shard(folder, lambda tensors: tensors.update({KNOWN_WEIGHT: tensors[KNOWN_WEIGHT][:-1].clone()}))


def drop_listed_tensor(folder: Path) -> str:
    return rewrite_shard(folder, lambda tensors: tensors.pop(KNOWN_WEIGHT))


def add_stray_shard(folder: Path) -> str:
    shutil.copy(shard_of(folder, KNOWN_WEIGHT), folder / "model-00007-of-00007.safetensors")
    return "model-00007-of-00007.safetensors"


def mistral_config(folder: Path) -> str:
    config = json.loads((folder / HF_CONFIG_FILE).read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (folder / HF_CONFIG_FILE).write_text(json.dumps(config))
    return HF_CONFIG_FILE


# damage(folder) -> the file the message must name, and what else it must say (the diagnosis or the fix).
MALFORMED: dict[str, tuple[Callable[[Path], str], str]] = {
    "truncated_shard": (truncate_shard, "truncated or corrupt"),
    "index_names_missing_shard": (delete_shard, "Copy the missing shards"),
    "overlapping_offsets": (overlap_offsets, "not a valid safetensors file"),
    "wrong_dtype": (int_weight, f"{KNOWN_WEIGHT} is I32"),
    "wrong_shape": (short_weight, f"{KNOWN_WEIGHT} in"),
    "config_of_another_model": (mistral_config, "Point --checkpoint.initial_load_path at a Llama folder"),
    "stray_shard": (add_stray_shard, "Remove it"),
    "index_lists_absent_tensor": (drop_listed_tensor, KNOWN_WEIGHT),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_folder_names_the_file(case: str, hf_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    damage, expected = MALFORMED[case]
    file_name = damage(folder)
    with pytest.raises(ConfigError) as error:
        read_hf_weights(folder, DEBUG)
    message = str(error.value)
    assert file_name in message and expected in message, message


def test_train_py_stops_on_a_truncated_shard(hf_folder: Path, tmp_path: Path) -> None:
    """--checkpoint.initial_load_in_hf on a damaged folder: exit 2 with the file named, and no checkpoint written."""
    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    shard = folder / truncate_shard(folder)
    dump = tmp_path / "run"
    code, stdout, stderr = finish(start_python(
        ROOT / "train.py", *TINY_RUN, "--training.steps", "1", "--checkpoint.enable", "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path", str(folder), "--job.dump_folder", str(dump)))
    output = stdout + stderr
    assert code == 2 and str(shard) in output and "Traceback" not in output, output
    assert not (dump / "checkpoint").exists() or not any((dump / "checkpoint").iterdir())


def test_last_save_in_hf_loads_in_transformers_and_resumes_from_step_0(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two bfloat16 steps whose last checkpoint is a Hugging Face folder; then the same command again, which finds
    that export, starts from its weights at step 0 and exports again."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dump = tmp_path / "run"
    command = [*TINY_RUN, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.last_save_in_hf",
               "--checkpoint.export_dtype", "bfloat16", "--job.dump_folder", str(dump)]
    code, stdout, stderr = finish(start_python(ROOT / "train.py", *command))
    assert code == 0, stdout + stderr
    export = dump / "checkpoint" / "step-2"
    names = {path.name for path in export.iterdir()}
    assert {INDEX_FILE, HF_CONFIG_FILE} <= names and any(name.startswith("model-") for name in names), names
    assert ".metadata" not in names and SHARDED_FOLDER not in names, names
    assert sorted(path.name for path in (dump / "checkpoint").iterdir()) == ["step-2"]
    with safe_open(shard_of(export, "lm_head.weight"), framework="pt") as f:
        assert f.get_slice("lm_head.weight").get_dtype() == "BF16"

    args = dataclasses.replace(DEBUG, max_seq_len=32)
    model = build_model(args)
    model.load_state_dict(read_hf_weights(export, args))
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    hf_logits = transformers_logits(export, tokens)
    with torch.no_grad():
        titan_logits = model.user_logits(tokens)
    max_diff = (hf_logits - titan_logits).abs().max().item()
    assert max_diff < 1e-4, f"transformers and Titan logits differ by up to {max_diff:.3g}"
    # The folder's tokenizer files give Titan's ids (BOS first; special-token text stays text).
    text = "Grüße, 世界! <|end_of_text|> def f(x):\n\treturn x"
    hf_tokenizer = importlib.import_module("transformers").AutoTokenizer.from_pretrained(export)
    assert hf_tokenizer(text)["input_ids"] == TOKENIZER.encode(text, bos=True, eos=False)

    first_run_losses = losses_by_step(dump)
    code, stdout, stderr = finish(start_python(ROOT / "train.py", *command))
    assert code == 0, stdout + stderr
    assert "is a Hugging Face export" in stdout + stderr, stdout + stderr
    assert [record["step"] for record in metric_records(dump) if "loss" in record] == [1, 2, 1, 2]
    # The export holds no data position, so the rerun's step 1 reads the first batch again: its loss is the exported
    # weights' (`model`, read from the folder above) on the batch the trainer builds first. rel 1e-5: the same fp32
    # model and batch, summed in another order (one thread in the run, this process's threads here).
    # The run's default block-causal attention: documents and targets from where the loader says documents end.
    cfg = load_job_config(command, world_size=1)
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    loader = build_dataloader(tokenizer, cfg.training, 0, 1)
    inputs, labels, document_ends = next(iter(loader))
    loader.close()
    with torch.no_grad():
        logits = model(inputs, *document_layout(document_ends))
        exported_loss = cross_entropy_loss(logits, mask_cross_document_targets(labels, document_ends), VOCAB).item()
    assert losses_by_step(dump)[1] == pytest.approx(exported_loss, rel=1e-5)
    assert first_run_losses[1] != pytest.approx(exported_loss, rel=1e-3)  # the seed init's loss is far from it
    assert (export / INDEX_FILE).is_file() and not (export / ".metadata").exists()


def test_convert_scripts(debug_model: Transformer, hf_folder: Path, tmp_path: Path) -> None:
    """Both scripts (and an import from a damaged folder) at once, each from a folder written here."""
    state_dict = debug_model.state_dict()
    save_dcp({"model": state_dict, "optimizer": {"exp_avg": torch.ones(3)}}, tmp_path / "step-1")
    damaged = tmp_path / "damaged"
    shutil.copytree(hf_folder, damaged)
    missing_shard = delete_shard(damaged)
    flags = ("--", "--model.flavor", "debugmodel")
    export = start_script("convert_to_hf.py", str(tmp_path / "step-1"), str(tmp_path / "hf"), "--max_shard_bytes",
                          str(SMALL_SHARD_BYTES), *flags)
    to_titan = start_script("convert_from_hf.py", str(hf_folder), str(tmp_path / "dcp"), *flags)
    from_damaged = start_script("convert_from_hf.py", str(damaged), str(tmp_path / "dcp_damaged"), *flags)
    for process in (export, to_titan):
        code, stdout, stderr = finish(process)
        assert code == 0, stdout + stderr
    code, stdout, stderr = finish(from_damaged)
    assert code == 2 and missing_shard in stdout + stderr and "Traceback" not in stdout + stderr, stdout + stderr
    assert not (tmp_path / "dcp_damaged").exists()

    # Export: bfloat16 by default, sharded, with the config of the debug flavor (the tokenizer files are
    # hf_tokenizer's to test).
    config = json.loads((tmp_path / "hf" / HF_CONFIG_FILE).read_text())
    assert config["vocab_size"] == VOCAB and config["intermediate_size"] == 768 and config["torch_dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"]) == (TOKENIZER.bos_id, TOKENIZER.eos_id)
    assert (tmp_path / "hf" / INDEX_FILE).is_file() and len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    expected_hf = {name: tensor.to(torch.bfloat16) for name, tensor in expected_hf_tensors(state_dict, DEBUG).items()}
    assert_same_tensors(read_safetensors(tmp_path / "hf"), expected_hf)

    # Import: a float32 DCP folder holding exactly the weights, with zero padding rows.
    assert_same_tensors(read_model_weights(tmp_path / "dcp"), with_zero_padding(state_dict, DEBUG))


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


def test_generate_script(debug_model: Transformer, hf_folder: Path, tmp_path: Path,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    save_dcp({"model": debug_model.state_dict()}, tmp_path / "step-1")
    prompt, max_new_tokens, temperature, top_k, seed = "def main(", 12, 0.9, 50, 3
    sampled_run = start_script("generate.py", str(tmp_path / "step-1"), "--prompt", prompt, "--max_new_tokens",
                               str(max_new_tokens), "--temperature", str(temperature), "--top_k", str(top_k),
                               "--seed", str(seed))
    greedy_run = start_script("generate.py", str(hf_folder), "--hf", "--prompt", prompt, "--temperature", "0",
                              "--max_new_tokens", str(max_new_tokens))

    # The same seed in this process must give the same sample as the script's run.
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    generate_script = importlib.import_module("generate")
    prompt_ids = TOKENIZER.encode(prompt, bos=True, eos=False)
    args = dataclasses.replace(DEBUG, max_seq_len=len(prompt_ids) + max_new_tokens)
    model = generate_script.build_model(FAMILIES["llama3"], args, debug_model.state_dict(), torch.device("cpu"))
    new_ids = generate_script.generate(model, prompt_ids, max_new_tokens, temperature, top_k, TOKENIZER.eos_id,
                                       torch.Generator().manual_seed(seed))
    expected_sample = TOKENIZER.decode(prompt_ids[1:] + new_ids)

    (sampled_code, sampled, sampled_err), (greedy_code, greedy, greedy_err) = finish(sampled_run), finish(greedy_run)
    assert sampled_code == greedy_code == 0, sampled_err + greedy_err
    assert len(new_ids) > 0 and sampled.rstrip("\n") == expected_sample
    assert greedy.rstrip("\n") == greedy_text(debug_model, prompt, max_new_tokens)
