"""Rotary position embeddings in Meta's layout: adjacent channels (2i, 2i+1) of each head form one rotated pair.
Hugging Face checkpoints use the rotate-half layout, so importing them permutes the rows of the query and key
projections (titan/checkpoint/hf.py)."""

import math

import torch
from torch import Tensor, nn

from titan.models.common.args import DecoderArgs, RopeScaling, RopeSpec, YarnScaling, yarn_mscale


def scale_rope_frequencies(freqs: Tensor, scaling: RopeScaling) -> Tensor:
    """Llama 3.1 long-context scaling (llama-models `apply_scaling`): keep high frequencies, divide low
    ones by `factor`, and interpolate between them by wavelength."""
    context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / freqs
    smooth = (context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    low_scaled = torch.where(wavelen > context / scaling.low_freq_factor, freqs / scaling.factor, interpolated)
    return torch.where(wavelen < context / scaling.high_freq_factor, freqs, low_scaled)


def yarn_frequencies(freqs: Tensor, scaling: YarnScaling, rotary_dim: int, theta: float) -> Tensor:
    """YaRN's frequencies (transformers' _compute_yarn_parameters): pairs past the beta_fast boundary keep their
    frequency, those before beta_slow's are divided by `factor`, linearly between; the boundaries rounded out to whole
    pairs where scaling.truncate."""
    def correction_dim(num_rotations: float) -> float:
        """The channel pair whose wavelength fits num_rotations times into the original context."""
        context = scaling.original_max_position_embeddings
        return rotary_dim * math.log(context / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    ramp = (torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)
    keep = 1 - ramp.clamp(0, 1)  # 1: the pair keeps its frequency (extrapolates), 0: it is interpolated
    return freqs / scaling.factor * (1 - keep) + freqs * keep


def precompute_rope_cache(args: DecoderArgs, rope: RopeSpec | None = None) -> Tensor:
    """cos and sin of position * freq of the table `rope` (None: args' rope_theta and rope_scaling) for every position
    up to max_seq_len and every rotated channel pair of a head: fp32 (max_seq_len, head_dim // 2, 2), cosines at
    [..., 0] and sines at [..., 1], on the current default device. head_dim is the rotated part of a head (all of it
    but in multi-head latent attention). Real tables rather than Meta's complex e^(i * position * freq), which
    inductor generates no code for: eager forwards read the same table as complex numbers (apply_rotary_emb). YaRN
    scales both by its attention factor, so that the rotated channels carry it into q.k."""
    rope = rope or RopeSpec(args.rope_theta, args.rope_scaling)
    head_dim = args.head_dim
    freqs = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    scale = 1.0
    if isinstance(rope.scaling, RopeScaling):
        freqs = scale_rope_frequencies(freqs, rope.scaling)
    elif isinstance(rope.scaling, YarnScaling):
        yarn = rope.scaling
        freqs = yarn_frequencies(freqs, yarn, head_dim, rope.theta)
        scale = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    positions = torch.arange(args.max_seq_len, dtype=torch.float32)
    angles = torch.outer(positions, freqs)  # (max_seq_len, head_dim // 2)
    return torch.stack([angles.cos() * scale, angles.sin() * scale], dim=-1)  # (max_seq_len, head_dim // 2, 2)


class RotaryEmbedding(nn.Module):
    """The rotary tables of precompute_rope_cache, one per distinct RopeSpec of the blocks (args.attention_specs()),
    read by token position: the model's input positions (restarting at each document under block-causal attention,
    this rank's rows under context parallel), or 0 .. seq - 1. A module, so that its tables move and materialise
    with the model (init_weights rebuilds them)."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        self.specs = list(dict.fromkeys(spec.rope for spec in args.attention_specs()))
        # Not persistent: they are a function of args, so checkpoints needn't carry them; init_weights rebuilds them.
        for name, rope in zip(self.table_names(), self.specs):
            self.register_buffer(name, precompute_rope_cache(args, rope), persistent=False)

    def table_names(self) -> list[str]:
        """The buffers' names, `cache` for the first table (every block's, in a family with one), then cache_1, ..."""
        return ["cache"] + [f"cache_{i}" for i in range(1, len(self.specs))]

    def rebuild(self) -> None:
        """Compute every table again, on the current default device."""
        for name, rope in zip(self.table_names(), self.specs):
            setattr(self, name, precompute_rope_cache(self.args, rope))

    def forward(self, positions: Tensor) -> dict[RopeSpec, Tensor]:
        """positions (seq,) or (bs, seq) -> each table's rows of them, (seq, head_dim // 2, 2) or
        (bs, seq, head_dim // 2, 2), by the RopeSpec it was built for."""
        return {rope: getattr(self, name)[positions] for name, rope in zip(self.table_names(), self.specs)}


def apply_rotary_emb(x: Tensor, rope_cache: Tensor) -> Tensor:
    """Rotate each channel pair (2i, 2i+1) of x (bs, seq, heads, head_dim) by its position's angle, in fp32:
    (a, b) -> (a cos - b sin, a sin + b cos), Meta's complex product, back in x's dtype. rope_cache: the rows of
    each sample's positions (bs, seq, head_dim // 2, 2), or rows shared by every sample whose first seq rows are
    x's positions (RotaryEmbedding's output for (seq,) positions, or a whole table for positions 0 .. seq - 1).

    Eagerly as a complex product (complex_rotation): on a GPU an upcast, one multiply and a downcast, where the same
    product written out in reals launches about nine kernels, four of them on stride-2 halves. Under torch.compile
    in reals (real_rotation): inductor fuses those into one kernel and generates no code for complex ops. Both are
    the same fp32 products and sums, equal up to the rounding order inside a complex multiply."""
    seq = x.size(1)
    rows = rope_cache if rope_cache.dim() == 4 else rope_cache[None, :seq]  # (bs or 1, seq, head_dim // 2, 2)
    if torch.compiler.is_compiling():
        return real_rotation(x, rows)
    return complex_rotation(x, rows)


def complex_rotation(x: Tensor, rows: Tensor) -> Tensor:
    """apply_rotary_emb as a complex product; rows (bs or 1, seq, head_dim // 2, 2)."""
    # (bs, seq, heads, head_dim // 2) complex: a pair's channels are one number's real and imaginary parts.
    # contiguous() copies only an fp32 x that is a view with odd strides (a part of a head), which view_as_complex
    # cannot read; a bf16 x's upcast is a new tensor already.
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    rotation = torch.view_as_complex(rows.float().contiguous()).unsqueeze(2)  # (bs or 1, seq, 1, head_dim // 2)
    return torch.view_as_real(pairs * rotation).flatten(3).type_as(x)


def real_rotation(x: Tensor, rows: Tensor) -> Tensor:
    """apply_rotary_emb in reals; rows (bs or 1, seq, head_dim // 2, 2)."""
    # Each (bs, seq, heads, head_dim // 2): the first and second channel of every pair.
    first, second = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = rows.unsqueeze(2).unbind(-1)  # each (bs or 1, seq, 1, head_dim // 2): the same for every head
    rotated = torch.stack([first * cos - second * sin, first * sin + second * cos], dim=-1)
    return rotated.flatten(3).type_as(x)  # (bs, seq, heads, head_dim // 2, 2) -> (bs, seq, heads, head_dim)
