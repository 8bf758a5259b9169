"""A family's model as its Hugging Face transformers class stores it, as data: the config.json fields, and a list of
tensor transforms, each saying how one Titan tensor (or a few) and one Hugging Face tensor (or a few) hold the same
numbers. titan/checkpoint/hf.py plans the reads and writes of each kind, shard by shard, and names no family itself.

The kinds, and what each does to a Titan tensor's chunk (the rows a rank holds):
- Same: the same tensor.
- VocabRows: the embedding's or output's rows, cut at the tokenizer's vocab_size (Titan pads them).
- RopeRows: wq/wk rows (and biases, QK-norms) permuted within each head, Titan's interleaved RoPE pairs against
  Hugging Face's rotate-half halves.
- ExpertSplit: a stacked (experts, out, in) tensor split into one Hugging Face tensor per expert.
- Interleaved: stacked expert tensors merged into one, their rows interleaved along its last dim, which moves there
  (a weight (experts, out, in) becomes (experts, in, k x out)): GPT-OSS's gate_up_proj holds w1 and w3.
- MXFP4: what Interleaved holds, quantized as GPT-OSS's release stores its experts (`*_blocks`, `*_scales`):
  dequantized on import, never written.
- OneOf: the first of these whose tensors a folder holds (an export writes the first).
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from titan.models.common.args import DecoderArgs


@dataclass(frozen=True)
class Same:
    """Titan tensor `fqn` is Hugging Face tensor `hf`."""

    fqn: str
    hf: str


@dataclass(frozen=True)
class VocabRows:
    """Titan's `fqn` (padded_vocab_size rows) is `hf`'s first vocab_size rows: the tokenizer's. Titan's padding rows
    have no Hugging Face row, and a hub checkpoint's extra rows no Titan row."""

    fqn: str
    hf: str


@dataclass(frozen=True)
class RopeRows:
    """Titan's `fqn` is `hf` with the rows of each head (head_dim of them) permuted: both rotate channel pairs of a
    head by position x freq_i, Titan's pairs (2i, 2i + 1), Hugging Face's (i, i + head_dim / 2). So Titan row 2i + r of
    a head is Hugging Face row r x head_dim / 2 + i (r = 0 the real part, 1 the imaginary one)."""

    fqn: str
    hf: str
    head_dim: int


@dataclass(frozen=True)
class ExpertSplit:
    """Titan's stacked `fqn` (experts, out, in) is one Hugging Face tensor per expert: `hf` with {expert} filled in."""

    fqn: str
    hf: str
    num_experts: int


@dataclass(frozen=True)
class Interleaved:
    """The Titan tensors `fqns` (each (experts, out, ...), all of one shape) are `hf`, whose last dim holds their dim
    1 in turn: row i of fqns[j] is index k x i + j there (k = len(fqns)); `hf`'s other dims are Titan's dims 0, 2, ...
    So stacked weights (experts, out, in) become (experts, in, k x out), and biases (experts, out) (experts, k x out).
    One tensor (k = 1) is a stacked weight transposed, as transformers' GPT-OSS experts hold down_proj."""

    fqns: tuple[str, ...]
    hf: str


@dataclass(frozen=True)
class MXFP4:
    """The Titan tensors `fqns` (each (experts, out, in)) stored in OCP MXFP4 as GPT-OSS's release stores its
    experts: `hf`_blocks (experts, k x out, in / 32, 16) uint8, two E2M1 codes a byte (the low nibble first), and
    `hf`_scales (experts, k x out, in / 32) uint8, each block's E8M0 exponent (biased by 127). Rows are interleaved
    as Interleaved's last dim (k = len(fqns)), and not transposed. Import only."""

    fqns: tuple[str, ...]
    hf: str


Transform = Union[Same, VocabRows, RopeRows, ExpertSplit, Interleaved, MXFP4, "OneOf"]


@dataclass(frozen=True)
class OneOf:
    """Ways a Hugging Face folder may hold the same Titan tensors: an import takes the first whose tensors are all in
    the folder, an export writes the first (a release's quantized experts come after the class's own layout)."""

    options: tuple[Transform, ...]


HF_EMBEDDING, HF_OUTPUT = "model.embed_tokens.weight", "lm_head.weight"
# SwiGLU w2(silu(w1 x) * w3 x): w1 is HF's gate, w3 its up and w2 its down projection (in Titan's order).
SWIGLU_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def swiglu_transforms(titan_prefix: str, hf_prefix: str) -> list[Transform]:
    """A SwiGLU feed-forward's weights, Titan's `titan_prefix`.w1.weight ... as HF's `hf_prefix`.gate_proj.weight ..."""
    return [Same(f"{titan_prefix}.{w}.weight", f"{hf_prefix}.{projection}.weight")
            for w, projection in SWIGLU_PROJECTIONS.items()]


def attention_transforms(titan: str, hf: str, head_dim: int, bias: bool = False,
                         rope_rows: bool = True) -> list[Transform]:
    """The shared grouped-query attention's projections (and their biases, with `bias`) in block `titan` as HF's
    self_attn in `hf`: wq/wk rows in RoPE's order unless `rope_rows` is False (a class that rotates Titan's pairs)."""
    transforms: list[Transform] = []
    for name, projection in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
        for kind in ("weight", "bias") if bias else ("weight",):
            fqn, hf_name = f"{titan}.attention.{name}.{kind}", f"{hf}.self_attn.{projection}.{kind}"
            rotated = rope_rows and name in ("wq", "wk")
            transforms.append(RopeRows(fqn, hf_name, head_dim) if rotated else Same(fqn, hf_name))
    return transforms


def norm_transforms(titan: str, hf: str) -> list[Transform]:
    """A block's two pre-norms."""
    return [Same(f"{titan}.attention_norm.weight", f"{hf}.input_layernorm.weight"),
            Same(f"{titan}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight")]


def split_expert_transforms(titan: str, hf: str, num_experts: int) -> list[Transform]:
    """A mixture of experts' stacked SwiGLU weights as one HF tensor per expert and projection (Qwen3-MoE's and
    DeepSeek-V3's hub layout)."""
    return [ExpertSplit(f"{titan}.moe.experts.{w}", f"{hf}.mlp.experts.{{expert}}.{projection}.weight", num_experts)
            for w, projection in SWIGLU_PROJECTIONS.items()]


def decoder_transforms(args: DecoderArgs, block: Callable[[str, str, int], list[Transform]]) -> list[Transform]:
    """Every transform of a decoder, in Titan's state-dict order: the embedding, `block`(Titan's layers.{i}, HF's
    model.layers.{i}, i) for each layer, the final norm, and the output unless it is the embedding's (tied: HF
    stores only the embedding)."""
    transforms: list[Transform] = [VocabRows("tok_embeddings.weight", HF_EMBEDDING)]
    for layer_id in range(args.n_layers):
        transforms += block(f"layers.{layer_id}", f"model.layers.{layer_id}", layer_id)
    transforms.append(Same("norm.weight", "model.norm.weight"))
    if not args.tie_embeddings:
        transforms.append(VocabRows("output.weight", HF_OUTPUT))
    return transforms


def decoder_config_fields(args: DecoderArgs) -> dict:
    """The config.json fields of the shared decoder's shapes and math, as every family's transformers class names
    them."""
    return {
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "attention_bias": False,
    }


def no_fields(args: DecoderArgs) -> dict:
    return {}


@dataclass(frozen=True)
class HFMapping:
    """One transformers class of a family (a family may have several: Qwen3 dense and Qwen3-MoE)."""

    name: str
    """For messages: "Llama", "Qwen3", "Qwen3-MoE"."""
    model_type: str
    architecture: str
    transforms: Callable[[Any], list[Transform]]
    """Every tensor of the class, from the args, as transforms of Titan's tensors, in Titan's state-dict order.
    Titan tensors none names (a routing bias the class lacks) keep their initial values on import and are left out
    of exports."""
    config_fields: Callable[[Any], dict]
    """The config.json fields, from the args, that fix the weights' shapes and the model's math (RoPE's and
    vocab_size aside): written on export, checked on import."""
    rope_scaling: Callable[[Any], dict | None] | None = None
    """config.json's rope_scaling, from the args, where the class writes its own keys (None: the shared layout of
    titan/checkpoint/hf.py hf_rope_scaling)."""
    hub_pads_vocab: bool = False
    """Its hub checkpoints may hold more vocab rows than the tokenizer has tokens."""
    unchecked_config_fields: Callable[[Any], dict] = no_fields
    """Fields that exports write, as the published configs have them, but that fix nothing, so imports don't check."""
    extra_layers: str | None = None
    """What the layers numbered n_layers and up of a hub checkpoint hold, which the transformers class skips (an
    import skips them too, and logs this); None: such tensors are an error, as any tensor the model lacks."""
    not_exported: Mapping[str, str] = field(default_factory=dict)
    """Titan FQN prefix -> why the transformers class has no such tensors: an export leaves them out, and logs it."""
