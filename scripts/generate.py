"""Sample text from a Titan checkpoint: a DCP step folder, or a Hugging Face folder with --hf.

    python scripts/generate.py outputs/debug_model/checkpoint/step-100 --prompt "def main("
    python scripts/generate.py hf_debug --hf --prompt "import" --temperature 0 --max_new_tokens 40
    python scripts/generate.py <step_folder> --prompt "The" -- --job.config_file <dump_folder>/config.toml

Everything after `--` is a Titan flag; --model.name, --model.flavor, --model.tokenizer_path,
--model.vocab_size_multiple_of and, for a mixture of experts, --moe.load_balance_coeff must be the checkpoint's.
Runs on the GPU if there is one, else on the CPU. Each new token reruns the whole sequence (the model has no KV
cache), which is fine for the short samples this is for.
"""

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from checkpoint_common import build_args, checkpoint_parser, parse_model_flags, read_checked_weights, run_script
from titan.checkpoint.hf_io import read_hf_weights
from titan.models.common.family import ModelFamily
from titan.models.families import FAMILIES
from titan_flags import parse_with_titan_flags


def parse_cli() -> tuple[argparse.Namespace, list[str]]:
    parser = checkpoint_parser(__doc__)
    parser.add_argument("checkpoint", help="Titan DCP step folder (a path or an s3://, gs:// URL), or a local Hugging "
                                           "Face folder with --hf")
    parser.add_argument("--hf", action="store_true", help="checkpoint is a Hugging Face folder (LlamaForCausalLM, "
                                                          "or with --model.name qwen3 Qwen3(Moe)ForCausalLM)")
    parser.add_argument("--prompt", default="", help="text to continue (default: none, start from BOS)")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="stop after this many tokens, or at EOS")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="divide logits by this before sampling; 0 picks the most likely token (greedy)")
    parser.add_argument("--top_k", type=int, default=None, help="sample among the k most likely tokens only "
                                                               "(default: all)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same text")
    cli, titan_flags = parse_with_titan_flags(parser)
    if cli.max_new_tokens < 1:
        parser.error(f"--max_new_tokens must be at least 1 (got {cli.max_new_tokens}).")
    if cli.temperature < 0:
        parser.error(f"--temperature must be 0 (greedy) or positive (got {cli.temperature}).")
    if cli.top_k is not None and cli.top_k < 1:
        parser.error(f"--top_k must be at least 1 (got {cli.top_k}); leave it out to sample from every token.")
    return cli, titan_flags


def build_model(family: ModelFamily, args: Any, state_dict: dict[str, Tensor], device: torch.device) -> nn.Module:
    """Build on meta and adopt the checkpoint's tensors (in float32) as the parameters: initialising weights
    only to overwrite them would cost minutes on a CPU for an 8B model. Checkpoints don't hold the rotary
    tables (non-persistent buffers), so they are built here, as init_weights builds them."""
    with torch.device("meta"):
        model = family.model(args)
    model.load_state_dict({fqn: tensor.to(device, torch.float32) for fqn, tensor in state_dict.items()}, assign=True)
    with torch.device(device):
        model.rope.rebuild()
    return model.eval()


def sample_next(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> Tensor:
    """One token id (0-dim) from the logits (vocab,) of the last position."""
    if temperature == 0:
        return logits.argmax()
    logits = logits.float() / temperature
    if top_k is not None:
        kth_largest = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[0]


@torch.no_grad()
def generate(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, temperature: float,
             top_k: int | None, eos_id: int, generator: torch.Generator) -> list[int]:
    """The ids sampled after prompt_ids, stopping after max_new_tokens or at EOS (which is not returned)."""
    tokens = torch.tensor([prompt_ids], device=generator.device)  # (1, seq)
    new_ids: list[int] = []
    for _ in range(max_new_tokens):
        next_id = sample_next(model.user_logits(tokens)[0, -1], temperature, top_k, generator)
        if next_id.item() == eos_id:
            break
        new_ids.append(int(next_id.item()))
        tokens = torch.cat([tokens, next_id.view(1, 1)], dim=1)  # (1, seq + 1)
    return new_ids


def main() -> None:
    cli, titan_flags = parse_cli()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_cfg, moe_cfg, tokenizer = parse_model_flags(titan_flags)
    prompt_ids = tokenizer.encode(cli.prompt, bos=True, eos=False)
    # The rotary table only needs to reach the last position sampled; a position's angles don't depend on its length.
    args = build_args(model_cfg, moe_cfg, tokenizer, len(prompt_ids) + cli.max_new_tokens)
    if cli.hf:
        state_dict = read_hf_weights(Path(cli.checkpoint), args)
    else:
        state_dict = read_checked_weights(cli.checkpoint, args)
    model = build_model(FAMILIES[model_cfg.name], args, state_dict, device)
    generator = torch.Generator(device=device).manual_seed(cli.seed)
    new_ids = generate(model, prompt_ids, cli.max_new_tokens, cli.temperature, cli.top_k, tokenizer.eos_id, generator)
    print(tokenizer.decode(prompt_ids[1 if tokenizer.bos_id is not None else 0:] + new_ids))  # without the BOS


if __name__ == "__main__":
    raise SystemExit(run_script(main))
