"""The decoder every family builds: token embedding, rotary table, the family's blocks, final norm, output layer and
chunked loss, in one forward. Pure math on plain nn.Linear / nn.Embedding, built on meta and filled by the family's
init."""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from titan.models.common.args import DecoderArgs, padded_vocab_size
from titan.models.common.attention import AttentionMask, sequence_positions
from titan.models.common.loss import OutputLoss
from titan.models.common.mtp import MultiTokenPrediction
from titan.models.common.norms import RMSNorm
from titan.models.common.rotary import RotaryEmbedding


class Decoder(nn.Module):
    """A decoder of `block`s, each built from args and its layer id by the family (Llama's, Qwen3's, DeepSeek-V3's),
    with an output layer of its own or, with args.tie_embeddings, the embedding's matrix, and with args.mtp_depth
    multi-token prediction modules (titan/models/common/mtp.py) of blocks built by `mtp_block`.

    The embedding and output have padded_vocab_size(vocab_size, vocab_size_multiple_of) rows so their
    shapes split evenly. forward() returns logits over that padded vocab; the padded columns are
    meaningless, so the losses and user_logits drop them.
    """

    def __init__(self, args: DecoderArgs, block: Callable[[Any, int], nn.Module],
                 mtp_block: Callable[[Any], nn.Module] | None = None) -> None:
        super().__init__()
        padded_vocab = padded_vocab_size(args.vocab_size, args.vocab_size_multiple_of)
        mtp = MultiTokenPrediction(args, mtp_block) if args.mtp_depth > 0 else None
        self.assemble(args, tok_embeddings=nn.Embedding(padded_vocab, args.dim),
                      layers={str(layer_id): block(args, layer_id) for layer_id in range(args.n_layers)},
                      norm=RMSNorm(args.dim, eps=args.norm_eps), output=nn.Linear(args.dim, padded_vocab, bias=False),
                      mtp=mtp)
        tie_output(self)

    def assemble(self, args: DecoderArgs, tok_embeddings: nn.Module | None, layers: dict[str, nn.Module],
                 norm: nn.Module | None, output: nn.Module | None, rope: RotaryEmbedding | None = None,
                 mtp: MultiTokenPrediction | None = None) -> None:
        """Hold these parts (absent ones None), with a rotary table (a new one unless given), attention mask and
        output loss of its own, in the order that names the state dict's entries. A pipeline stage holds no
        multi-token prediction (config validation rejects the two together)."""
        self.args = args
        self.vocab_size = args.vocab_size
        self.tok_embeddings = tok_embeddings
        self.rope = rope if rope is not None else RotaryEmbedding(args)
        self.layers = nn.ModuleDict(layers)
        self.norm = norm
        self.output = output
        self.mtp = mtp
        self.attention_mask = AttentionMask(args.attn_backend, [spec.window for spec in args.attention_specs()])
        self.output_loss = OutputLoss(args.vocab_size, args.loss_chunk_size)

    def part(self, layers: dict[str, nn.Module], tok_embeddings: nn.Module | None, norm: nn.Module | None,
             output: nn.Module | None, rope: RotaryEmbedding | None = None) -> "Decoder":
        """A decoder of this one's class and args that holds the given modules, under the whole model's FQNs: a
        pipeline stage (some blocks; the embedding on the first, the final norm and output on the last), or a rank's
        stages together. It shares the modules, and its forward is the model's, skipping what it does not hold. Its
        rotary table (unless given), attention mask and output loss are new ones, on the current default device,
        which later stages may replace."""
        part = type(self).__new__(type(self))
        nn.Module.__init__(part)
        part.assemble(self.args, tok_embeddings, layers, norm, output, rope)
        return part

    def forward(self, tokens: Tensor, positions: Tensor | None = None, document_ids: Tensor | None = None,
                labels: Tensor | None = None) -> Tensor:
        """tokens (bs, seq) -> logits (bs, seq, padded_vocab); with labels (bs, seq), the summed loss of the valid
        targets instead (output_loss), without the whole logits. positions (bs, seq): each token's rotary position
        (None: 0 .. seq - 1). document_ids (bs, seq): attention stays within a document (block-causal); None:
        causal over the sequence. attention.document_layout makes both from where documents end. Each block reads the
        rotary rows and the mask of its own AttentionSpec (args.layer_attention). A part without the embedding (a
        later pipeline stage) takes hidden states (bs, seq, dim) and their positions instead of tokens; one without
        the output returns its hidden states."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (bs, seq, dim)
        ropes = self.rope(sequence_positions(tokens) if positions is None else positions)
        masks = self.attention_mask(h, document_ids)  # h: (bs, seq, dim), a DTensor's global shape under TP
        for layer_id, layer in self.layers.items():
            spec = self.args.layer_attention(int(layer_id))
            h = layer(h, ropes[spec.rope], masks[spec.window])
        if self.output is None:
            return h
        if labels is None:
            return self.output(self.norm(h))
        loss = self.output_loss(self.norm(h), labels, self.output)
        if self.mtp is not None and torch.is_grad_enabled():  # the modules train the trunk; evaluation skips them
            spec = self.args.layer_attention(self.args.n_layers)  # the first module's, which every module shares
            loss = loss + self.mtp(h, tokens, labels, document_ids, ropes[spec.rope], masks[spec.window],
                                   self.tok_embeddings, self.output, self.output_loss)
        return loss

    def user_logits(self, tokens: Tensor) -> Tensor:
        """tokens (bs, seq) -> logits (bs, seq, vocab_size) over real token ids, for generation and export."""
        return self(tokens)[..., : self.vocab_size]


def tie_output(model: nn.Module) -> None:
    """Make a tied model's output matrix its embedding's again, for a model (or the stage holding both) after
    to_empty(), which gives every module a tensor of its own, or after a stage that distributed them separately."""
    if model.args.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight
