"""What the Hugging Face interop tests of every family share: the shipped tokenizer and its odd vocabulary, the
Llama debug model's args and folder shards, loading an exported folder in transformers and drawing its weights for a
comparison, both models' next-token gradients, reading a folder's safetensors files whole and comparing them,
Llama's HF layout written out from hf.py's docstring, a DCP step folder on one process, and the scripts started side
by side."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from titan.checkpoint.hf import VOCAB_FQNS, export_transforms, rotate_half_rows
from titan.data.tokenizer import SHIPPED_TOKENIZER, build_tokenizer
from titan.models.common.loss import cross_entropy_loss
from titan.models.common.rotary import RopeScaling
from titan.models.llama.args import LLAMA3_FLAVORS, ModelArgs

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 2256  # the shipped tokenizer's odd size: padded to 2304, so the padding rows are exercised
TOKENIZER = build_tokenizer(SHIPPED_TOKENIZER)
DEBUG = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=VOCAB)
"""The Llama debug flavor at the shipped tokenizer's vocabulary (conftest.py's debug_model and hf_folder)."""
# About 3 MB per layer in float32: the debug model's float32 export spreads over 6 files.
SMALL_SHARD_BYTES = 4 * 10**6
# RoPE scaling that bites within a few dozen positions, so a wrong rope_scaling export shows in the logits.
SHORT_CONTEXT_SCALING = RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=64)


def transformers_model(folder: Path) -> torch.nn.Module:
    """The folder's model as transformers' AutoModelForCausalLM loads it, float32, eager attention, in eval mode."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def spread_transformers_weights(hf_model: torch.nn.Module) -> None:
    """Redraw a transformers model's weights in place as harness.models.build_for_comparison draws Titan's: every
    norm weight around 1, the routers (mlp.gate) wide, the other weights at std 0.1, and a routing correction bias
    (DeepSeek-V3's e_score_correction_bias, where the model has one) nonzero."""
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
            else:
                param.normal_(0.0, 0.5 if "mlp.gate." in name else 0.1)
        for name, buffer in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)


def transformers_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of the folder's transformers model (transformers_model: float32 whatever the files' dtype) on
    `tokens`."""
    hf_model = transformers_model(folder)
    with torch.no_grad():
        return hf_model(tokens).logits


def next_token_gradients(model: torch.nn.Module, hf_model: torch.nn.Module, vocab: int = VOCAB
                         ) -> dict[str, torch.Tensor]:
    """Back-propagate the next-token loss of sample_tokens() through the Titan model and the transformers model of the
    same weights (each's gradients zeroed first), and return the transformers model's gradients by name."""
    tokens = sample_tokens()
    labels = torch.roll(tokens, -1, dims=1)
    model.zero_grad()
    hf_model.zero_grad()
    cross_entropy_loss(model(tokens), labels, vocab).backward()
    cross_entropy_loss(hf_model(tokens).logits, labels, vocab).backward()
    return {name: param.grad for name, param in hf_model.named_parameters()}


def sample_tokens(seq: int = 48) -> torch.Tensor:
    """Two rows of `seq` token ids below VOCAB, the same at every call."""
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(0))


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every .safetensors file in `folder`, read by the `safetensors` package."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The same names, and under each a tensor of the same dtype and shape, equal bit for bit."""
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def with_zero_padding(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """`state_dict` with the padding rows of the embedding and output zeroed, as an HF import leaves them."""
    padded = dict(state_dict)
    for fqn in VOCAB_FQNS:
        padded[fqn] = state_dict[fqn].clone()
        padded[fqn][args.vocab_size:] = 0
    return padded


def expected_hf_tensors(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """The HF tensors of a Titan Llama state dict, whole tensors at a time from the layout in hf.py's docstring (the
    code under test goes row block by row block): vocab rows cut at vocab_size, wq/wk rows moved to their HF rows."""
    head_dim = args.dim // args.n_heads
    tensors = {}
    for transform in export_transforms(args):
        fqn, hf_name = transform.fqn, transform.hf
        tensor = state_dict[fqn][:args.vocab_size] if fqn in VOCAB_FQNS else state_dict[fqn]
        if fqn.endswith(("attention.wq.weight", "attention.wk.weight")):
            permuted = torch.empty_like(tensor)
            permuted[rotate_half_rows(torch.arange(len(tensor)), head_dim)] = tensor
            tensor = permuted
        tensors[hf_name] = tensor
    return tensors


def save_dcp(state: dict, folder: Path) -> None:
    """`state` as a DCP checkpoint folder, written by this one process (what the scripts read as a step folder)."""
    dcp.save(state, checkpoint_id=folder, no_dist=True)


def start_python(script: Path, *args: str) -> subprocess.Popen:
    """Start a Python script from the repo root, offline; the tests start independent runs together to save time."""
    # One thread each: two or three runs share the CPU cores.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def start_script(name: str, *args: str) -> subprocess.Popen:
    """start_python on scripts/<name>."""
    return start_python(ROOT / "scripts" / name, *args)


def finish(process: subprocess.Popen) -> tuple[int, str, str]:
    """Wait for a started script: its exit code, stdout and stderr."""
    stdout, stderr = process.communicate(timeout=300)
    return process.returncode, stdout, stderr
