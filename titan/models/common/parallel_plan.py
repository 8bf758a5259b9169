"""How the parallel stages split a family's model, as data: module names and the kind of split each takes.
titan/parallel applies a plan and names no module itself; a family's plan names only its own modules."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

TensorParallelStyle = Literal["vocab_embedding", "vocab_output", "sequence_norm", "head_norm", "gather_input",
                              "gather_attention_input", "colwise", "rowwise"]
"""How tensor parallel splits a module (titan/parallel/tp.py TENSOR_PARALLEL_STYLES builds each):
- vocab_embedding: the embedding's rows split over the vocab, its output sharded along the sequence;
- vocab_output: the output layer's columns split over the vocab (the logits stay sharded for a vocab-parallel loss);
- sequence_norm: a norm over `dim` of sequence-sharded activations (sequence parallel), its weight replicated;
- head_norm: a norm over each head's channels of head-sharded activations (QK-norm), its weight replicated;
- gather_input: the module's one input, sequence-sharded, gathered whole before it runs;
- gather_attention_input: the same for attention's (x, rotary rows, mask), of which only x is sharded;
- colwise / rowwise: Megatron's split of a linear layer's outputs / inputs; a rowwise output is reduce-scattered
  back along the sequence."""

DECODER_TENSOR_PARALLEL: dict[str, TensorParallelStyle] = {
    "tok_embeddings": "vocab_embedding",
    "norm": "sequence_norm",
    "output": "vocab_output",
}
"""The shared decoder's own parts (titan/models/common/decoder.py), which every family has."""

ATTENTION_TENSOR_PARALLEL: dict[str, TensorParallelStyle] = {
    "attention_norm": "sequence_norm",
    "attention": "gather_attention_input",
    "attention.wq": "colwise",
    "attention.wk": "colwise",
    "attention.wv": "colwise",
    "attention.wo": "rowwise",
}
"""A block's grouped-query attention (titan/models/common/attention.py) and its pre-norm: heads split over ranks."""

FEED_FORWARD_TENSOR_PARALLEL: dict[str, TensorParallelStyle] = {
    "ffn_norm": "sequence_norm",
    "feed_forward": "gather_input",
    "feed_forward.w1": "colwise",
    "feed_forward.w2": "rowwise",
    "feed_forward.w3": "colwise",
}
"""A block's SwiGLU feed-forward (titan/models/common/feed_forward.py) and its pre-norm: hidden units split."""


@dataclass(frozen=True)
class ParallelPlan:
    """A family's model as the parallel stages split it. FSDP shards each block of `layers` and then the root (the
    decoder's own parts); under expert parallel each block's `experts` are split over the EP ranks and sharded by
    FSDP over the ranks that hold the same experts, as a unit of their own."""

    tensor_parallel: Mapping[str, TensorParallelStyle]
    """Each block's modules by FQN within the block, and how tensor parallel splits them."""
    root_tensor_parallel: Mapping[str, TensorParallelStyle] = field(default_factory=lambda: DECODER_TENSOR_PARALLEL)
    """The modules outside the blocks, by FQN (a pipeline stage holds some of them)."""
    experts: str = "moe.experts"
    """FQN within a block of a mixture of experts' GroupedExperts (titan/models/common/moe.py); a block without one
    is dense."""
