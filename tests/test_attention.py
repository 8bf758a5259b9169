"""Block-causal attention over packed documents: the packed batch computes what each document computes on its own."""

import itertools
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention
from torch.utils._debug_mode import DebugMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titan.config.errors import ConfigError
from titan.data.micro_batch import document_layout, mask_cross_document_targets
from titan.models.common.attention import (
    AttentionMask,
    build_block_mask,
    build_dense_mask,
    build_inner_attention,
    causal_window,
    compile_visible_region,
    sink_transform,
)
from titan.models.common.loss import IGNORE_INDEX
from titan.models.llama import ModelArgs
from titan.parallel import ac
from titan.parallel.ac import apply_ac, selective_policy
from titan.validate import load_job_config

from harness.models import build_model
from reference.attention_ref import attention_with_sink_column

VOCAB, EOS = 2256, 2255
SEQ = 24
# Where documents start (right after an EOS) in each packed row of SEQ tokens, and what the row shows.
LAYOUTS = {
    "one document": [0],
    "two documents": [0, 9],
    "many documents": [0, 3, 4, 11, 12, 20, 23],
    "a document longer than the sequence": [],  # the window starts and ends inside one document
    "documents cut by both ends": [7, 15],  # the first starts before the window, the last ends after it
}
# The model of every test here, by attention backend.
MODELS = {backend: ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=SEQ,
                             attn_backend=backend) for backend in ("sdpa", "flex")}


def packed_row(starts: list[int], seq: int = SEQ) -> torch.Tensor:
    torch.manual_seed(len(starts))
    tokens = torch.randint(0, EOS, (1, seq))
    tokens[0, [start - 1 for start in starts if start > 0]] = EOS
    return tokens


def documents(starts: list[int]) -> list[slice]:
    """The row's documents as slices: a document starts after each EOS and at the row's first token."""
    bounds = sorted({0, *starts, SEQ})
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def test_layout_restarts_positions_after_every_eos() -> None:
    tokens = packed_row(LAYOUTS["documents cut by both ends"])
    positions, document_ids = document_layout(tokens == EOS)
    assert positions[0].tolist() == [*range(7), *range(8), *range(9)]
    assert document_ids[0].tolist() == [0] * 7 + [1] * 8 + [2] * 9


def test_next_document_start_is_no_target_but_the_eos_is() -> None:
    inputs = torch.tensor([[4, EOS, 6, EOS]])
    labels = torch.tensor([[EOS, 6, EOS, 8]])
    assert mask_cross_document_targets(labels, inputs == EOS).tolist() == [[EOS, IGNORE_INDEX, EOS, IGNORE_INDEX]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_causal_equals_each_document_alone(layout: str) -> None:
    """Logits and every parameter's gradient of the packed row (SDPA with the dense block-causal mask) equal those
    of running each document on its own (causal, positions from 0), within fp32 tolerance."""
    model, starts = build_model(MODELS["sdpa"]), LAYOUTS[layout]
    tokens = packed_row(starts)
    weights = torch.randn(1, SEQ, model.output.out_features)  # a loss that reaches every logit

    model.zero_grad()
    packed = model(tokens, *document_layout(tokens == EOS))
    (packed * weights).sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}

    model.zero_grad()
    alone = []
    for document in documents(starts):
        logits = model(tokens[:, document])  # positions 0 .. len - 1, causal
        (logits * weights[:, document]).sum().backward()
        alone.append(logits.detach())
    torch.testing.assert_close(packed.detach(), torch.cat(alone, dim=1), rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        # Sums over tokens in another order: fp32 roundings relative to the gradient's own scale.
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-5, atol=1e-5 * p.grad.abs().max().item(),
                                   msg=name)


# Rows of 4 FlexAttention blocks (128 tokens each), given by where their documents start: documents that cross
# block boundaries, and so blocks (128 queries x 128 keys) that are empty, partial and full, which the BlockMask must
# tell apart for the kernel's block-sparse skipping.
BLOCK = 128
LONG_SEQ = 4 * BLOCK
LONG_LAYOUTS = {
    "documents crossing blocks": [0, 100, 130, 300, 301, 450],
    "one document": [0],  # causal: every block below the diagonal is full
    "documents cut by both ends": [200, 383],
}


def mask_of_documents(starts: list[int], seq: int) -> Tensor:
    """The block-causal mask (seq, seq) of a row whose documents start at `starts` (and at 0), from the documents
    themselves: query i reads key j when j <= i and no document starts in (j, i]."""
    bounds = sorted({0, *starts, seq})
    mask = torch.zeros(seq, seq, dtype=torch.bool)
    for start, end in zip(bounds, bounds[1:]):
        mask[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    return mask


def full_blocks(block_mask: BlockMask) -> Tensor:
    """(bs, 1, q_blocks, kv_blocks): the blocks the BlockMask marks full, whose keys every query reads unmasked."""
    dense = torch.zeros(block_mask.to_dense().shape, dtype=torch.bool)
    counts, indices = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
    for b, h, q_block in itertools.product(*map(range, counts.shape)):
        dense[b, h, q_block, indices[b, h, q_block, :counts[b, h, q_block]]] = True
    return dense


def test_flex_block_mask_equals_the_documents_mask() -> None:
    """FlexAttention's BlockMask over several 128-token blocks is the mask of the row's documents: token by token,
    block by block (skipped, partial and full blocks), and in the output of the block-sparse kernel (compiled:
    eager FlexAttention ignores the block structure) against SDPA under the documents' dense mask (forward only:
    torch has no FlexAttention backward on CPU)."""
    rows = list(LONG_LAYOUTS.values())
    tokens = torch.cat([packed_row(starts, LONG_SEQ) for starts in rows])
    _, document_ids = document_layout(tokens == EOS)
    block_mask = build_block_mask(document_ids, LONG_SEQ, tokens.device)
    want = torch.stack([mask_of_documents(starts, LONG_SEQ) for starts in rows])[:, None]  # (bs, 1, seq, seq)
    assert torch.equal(create_mask(block_mask.mask_mod, len(rows), 1, LONG_SEQ, LONG_SEQ, device="cpu"), want)
    tiles = want.unflatten(2, (-1, BLOCK)).unflatten(4, (-1, BLOCK))  # (bs, 1, q_blocks, 128, kv_blocks, 128)
    read, full = tiles.any(dim=5).any(dim=3), tiles.all(dim=5).all(dim=3)  # (bs, 1, q_blocks, kv_blocks) each
    below_diagonal = torch.ones(read.shape[-2:], dtype=torch.bool).tril(-1)
    assert all((kind & below_diagonal).any() for kind in (~read, read & ~full, full))  # skipped, partial, full
    assert torch.equal(block_mask.to_dense().bool(), read)
    assert torch.equal(full_blocks(block_mask), full)
    torch.manual_seed(0)
    q, k, v = torch.randn(3, len(rows), 2, LONG_SEQ, 16).unbind(0)  # (bs, heads, seq, head_dim) each
    got = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=want), rtol=1e-5, atol=1e-5)


def windowed_mask(starts: list[int], seq: int, window: int) -> Tensor:
    """mask_of_documents within a sliding window, from positions: query i also needs key j to be less than `window`
    positions back (transformers' sliding window keeps j > i - window)."""
    positions = torch.arange(seq)
    recent = positions[None, :] > positions[:, None] - window  # (seq, seq): [query, key]
    return mask_of_documents(starts, seq) & recent


@pytest.mark.parametrize("window", [1, 128, 200])
def test_windowed_masks_keep_the_keys_within_the_window(window: int) -> None:
    """A window's dense mask (SDPA, with and without documents) and FlexAttention's BlockMask are the mask built from
    positions, and the BlockMask is block-sparse: a query block reads at most the key blocks its window reaches
    (ceil((window - 1) / 128) + 1 of them), so a window costs what it computes; its compiled kernel computes what SDPA
    computes under the dense mask."""
    rows = list(LONG_LAYOUTS.values())
    tokens = torch.cat([packed_row(starts, LONG_SEQ) for starts in rows])
    _, document_ids = document_layout(tokens == EOS)
    want = torch.stack([windowed_mask(starts, LONG_SEQ, window) for starts in rows])[:, None]  # (bs, 1, seq, seq)
    assert torch.equal(build_dense_mask(document_ids, window), want)
    assert torch.equal(causal_window(LONG_SEQ, window, torch.device("cpu")), windowed_mask([], LONG_SEQ, window))
    block_mask = build_block_mask(document_ids, LONG_SEQ, tokens.device, window)
    assert torch.equal(create_mask(block_mask.mask_mod, len(rows), 1, LONG_SEQ, LONG_SEQ, device="cpu"), want)
    causal_blocks = build_block_mask(None, LONG_SEQ, tokens.device, window).to_dense().bool()[0, 0]
    reach = -(-(window - 1) // BLOCK) + 1
    assert causal_blocks.sum(dim=-1).max() == min(reach, LONG_SEQ // BLOCK)
    torch.manual_seed(0)
    q, k, v = torch.randn(3, len(rows), 2, LONG_SEQ, 16).unbind(0)  # (bs, heads, seq, head_dim) each
    got = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_sinks_equal_an_explicit_softmax_with_the_sink_column(backend: str) -> None:
    """Attention with sinks (the kernel's log-sum-exp through sink_transform) equals the softmax written out with each
    head's sink as one more logit column (tests/reference/attention_ref.py), over documents and a window, grouped kv
    heads included; and, through SDPA's written-out path, in the gradients of q, k, v and the sinks too. FlexAttention
    runs its forward only (torch has no FlexAttention backward on CPU); on a GPU the trainer runs both."""
    starts = LONG_LAYOUTS["documents crossing blocks"]
    tokens = packed_row(starts, LONG_SEQ)
    _, document_ids = document_layout(tokens == EOS)
    torch.manual_seed(0)
    training = backend == "sdpa"
    q = torch.randn(1, 4, LONG_SEQ, 16, requires_grad=training)
    k, v = (torch.randn(1, 2, LONG_SEQ, 16, requires_grad=training) for _ in range(2))
    sinks = torch.randn(4, requires_grad=training)
    mask = AttentionMask(backend, [BLOCK])(torch.empty(1, LONG_SEQ, 1), document_ids)[BLOCK]
    want = attention_with_sink_column(q, k, v, build_dense_mask(document_ids, BLOCK), sinks)
    got = build_inner_attention(backend)(q, k, v, mask, out_transform=sink_transform(sinks))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if training:
        upstream = torch.randn_like(want)
        want_grads = torch.autograd.grad((want * upstream).sum(), (q, k, v, sinks))
        got_grads = torch.autograd.grad((got * upstream).sum(), (q, k, v, sinks))
        for name, got_grad, want_grad in zip("qkv", got_grads, want_grads):
            torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(got_grads[3], want_grads[3], rtol=1e-5, atol=1e-4, msg="sinks")


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="torch has no FlexAttention backward on CPU; the forward is checked on CPU above")
def test_flex_sinks_and_window_gradients_equal_the_sink_column_cuda() -> None:
    """The trainer's FlexAttention on a GPU (compiled, a block-sparse window over documents, sinks on its
    log-sum-exp): output and the gradients of q, k, v and the sinks equal the explicit softmax with the sink column,
    fp32 on both sides."""
    starts = LONG_LAYOUTS["documents crossing blocks"]
    tokens = packed_row(starts, LONG_SEQ).cuda()
    _, document_ids = document_layout(tokens == EOS)
    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 4, LONG_SEQ, 16, device="cuda", generator=generator, requires_grad=True)
    k, v = (torch.randn(1, 2, LONG_SEQ, 16, device="cuda", generator=generator, requires_grad=True)
            for _ in range(2))
    sinks = torch.randn(4, device="cuda", generator=generator, requires_grad=True)
    mask = AttentionMask("flex", [BLOCK])(torch.empty(1, LONG_SEQ, 1, device="cuda"), document_ids)[BLOCK]
    got = build_inner_attention("flex")(q, k, v, mask, out_transform=sink_transform(sinks))
    want = attention_with_sink_column(q, k, v, build_dense_mask(document_ids, BLOCK), sinks)
    upstream = torch.randn_like(want)
    for name, got_tensor, want_tensor in zip(
            ("output", "q", "k", "v", "sinks"), (got, *torch.autograd.grad((got * upstream).sum(), (q, k, v, sinks))),
            (want, *torch.autograd.grad((want * upstream).sum(), (q, k, v, sinks)))):
        torch.testing.assert_close(got_tensor, want_tensor, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("layout", ["two documents", "many documents", "documents cut by both ends"])
def test_flex_model_computes_the_sdpa_logits(layout: str) -> None:
    """A flex model (its BlockMask) computes the logits an SDPA model (its dense mask) does."""
    tokens = torch.cat([packed_row(LAYOUTS[layout]), packed_row(LAYOUTS["many documents"])])
    flex, sdpa = build_model(MODELS["flex"]), build_model(MODELS["sdpa"])
    with torch.no_grad():
        torch.testing.assert_close(flex(tokens, *document_layout(tokens == EOS)),
                                   sdpa(tokens, *document_layout(tokens == EOS)), rtol=1e-5, atol=1e-5)


def test_selective_ac_saves_flex_attention() -> None:
    """Selective "op" AC keeps FlexAttention's output, as it keeps SDPA's: the op reaches the policy as torch's
    flex_attention higher-order op (eagerly here; compiled blocks trace the same op into the graph, where the
    policy tags it), and recomputing it would cost a second attention forward."""
    tokens = packed_row(LAYOUTS["many documents"])
    _, document_ids = document_layout(tokens == EOS)
    block_mask = build_block_mask(document_ids, SEQ, tokens.device)
    policy, decisions = selective_policy(save_matmuls=True), []

    def recording_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        decisions.append((op, policy(ctx, op, *args, **kwargs)))
        return decisions[-1][1]

    q, k, v = torch.randn(3, 1, 2, SEQ, 16).unbind(0)  # no grad: torch has no FlexAttention backward on CPU
    checkpoint(lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask), q, k, v, use_reentrant=False,
               context_fn=lambda: create_selective_checkpoint_contexts(recording_policy))
    assert (torch.ops.higher_order.flex_attention, CheckpointPolicy.MUST_SAVE) in decisions, decisions


def test_compiled_flex_blocks_match_sdpa() -> None:
    """FlexAttention inside compiled blocks, as --compile.enable runs it (forward: CPU has no backward)."""
    tokens = torch.cat([packed_row(LAYOUTS["many documents"]), packed_row(LAYOUTS["two documents"])])
    flex, sdpa = build_model(MODELS["flex"]), build_model(MODELS["sdpa"])
    for block in flex.layers.values():
        block.compile(fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(flex(tokens, *document_layout(tokens == EOS)),
                                   sdpa(tokens, *document_layout(tokens == EOS)), rtol=1e-5, atol=1e-5)


def test_flex_backend_on_cpu_is_a_config_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU, where FlexAttention trains")
    with pytest.raises(ConfigError, match="--model.attn_backend flex needs a CUDA GPU"):
        load_job_config(["--model.attn_backend", "flex"], world_size=1)


def gated_region(a: Tensor, b: Tensor) -> Tensor:
    """A region to compile on its own, as small as inductor compiles (one fused kernel each way): what matters is
    that it is compiled code, not what it computes."""
    return a.sin() * b


class RegionBlock(torch.nn.Module):
    """A block whose costliest op is a region compiled on its own, as FlexAttention is in eager blocks on CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16, bias=False)
        self.region = compile_visible_region(gated_region)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)
        return self.region(h, h).relu()


def compiled_region_runs(save_ops: set) -> int:
    """How many times the forward and backward of a selectively checkpointed RegionBlock run compiled code, with
    the selective policy saving `save_ops`' outputs."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": RegionBlock()})
    apply_ac(model, "selective", "op", save_attention=False)
    x = torch.randn(2, 8, 16, requires_grad=True)
    with mock.patch.object(ac, "SAVE_ALWAYS", save_ops), DebugMode() as debug:
        model.layers["0"](x).sum().backward()
    return debug.debug_string().count("inductor_compiled_code")


def test_selective_ac_saves_a_compiled_attention_region_instead_of_running_it_again() -> None:
    """Selective checkpointing sees a region compiled with VISIBLE_REGION_OPTIONS as one op and keeps its output:
    its compiled code runs in forward and in backward, not a third time in the recompute, as it did when the policy
    could not see it (cause 3 of torchtitan's lead on the 1B job)."""
    assert compiled_region_runs(ac.SAVE_ALWAYS) == 2
    assert compiled_region_runs(ac.SAVE_ALWAYS - {torch.ops.higher_order.inductor_compiled_code}) == 3
