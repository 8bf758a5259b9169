"""Which layouts initialise their weights from a full copy of the model (titan/parallel/init.py needs_full_init):
those whose own random init cannot give a single process's weights, on the GPU as on the CPU."""

import dataclasses

import pytest
import torch
from torch import nn

from titan.models.llama import ModelArgs, Transformer, init_weights
from titan.models.llama.args import LLAMA3_FLAVORS
from titan.models.qwen3 import QWEN3_FLAVORS
from titan.models.qwen3 import Transformer as Qwen3Transformer
from titan.models.qwen3 import init_weights as qwen3_init_weights
from titan.parallel.ac import apply_ac, model_fqn
from titan.parallel.init import apply_full_init, needs_full_init

ARGS: ModelArgs = LLAMA3_FLAVORS["debugmodel"]


def seeded_init(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        init_weights(model)
    return model


def test_a_pipeline_stage_initialised_alone_draws_another_blocks_numbers() -> None:
    """Why every pipeline run initialises from a full copy, on any device: the second stage (blocks 3-5 and the
    output) initialised from the seed by itself draws, for block 3, the numbers a single process draws for the
    embedding and block 0, so its weights are not the single process's."""
    full = seeded_init(Transformer(ARGS))
    model = Transformer(ARGS)
    stage = seeded_init(model.part({str(i): model.layers[str(i)] for i in (3, 4, 5)}, tok_embeddings=None,
                                   norm=model.norm, output=model.output))
    assert not torch.equal(stage.layers["3"].attention.wq.weight, full.layers["3"].attention.wq.weight)


@pytest.mark.parametrize("pipelined, cpu_offload, sharded, full_copy", [
    (False, False, True, True),  # FSDP/TP: DTensor's RNG tracker draws other numbers than a single process
    (True, False, False, True),  # a pipeline stage (issue 33: stages drew overlapping streams on CUDA)
    (False, True, True, True),  # CPU offload: the shards are in host memory when they are initialised
    (False, False, False, False),  # one process
])
def test_layouts_that_initialise_from_a_full_copy(pipelined: bool, cpu_offload: bool, sharded: bool, full_copy: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(4, 4)
    monkeypatch.setattr("titan.parallel.init.is_sharded", lambda module: sharded)
    assert needs_full_init(model, pipelined, cpu_offload) == full_copy


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_checkpointed_model_gets_every_buffer_of_the_full_copy(mode: str) -> None:
    """Activation checkpointing renames every buffer under a block (`_checkpoint_wrapped_module.`), and a mixture of
    experts' token counts are in no state dict: each rank's buffers, whatever to_empty() left in them, become the
    full copy's, matched by the model's own FQN."""
    args = dataclasses.replace(QWEN3_FLAVORS["debugmodel_moe"], vocab_size=2256, max_seq_len=32, n_layers=2)
    full = Qwen3Transformer(args)
    qwen3_init_weights(full, "cpu")
    with torch.device("meta"):
        model = Qwen3Transformer(args)
    apply_ac(model, mode, "1", save_attention=False)
    model.to_empty(device="cpu")
    for buffer in model.buffers():
        buffer.fill_(float("nan"))
    apply_full_init(model, full)
    reference = dict(full.named_buffers())
    own = {model_fqn(name): buffer for name, buffer in model.named_buffers()}
    assert own.keys() == reference.keys() and any("tokens_per_expert" in name for name in own)
    for name, buffer in own.items():
        torch.testing.assert_close(buffer, reference[name], msg=name)
