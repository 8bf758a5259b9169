"""Import a Hugging Face folder (LlamaForCausalLM, or with --model.name qwen3 Qwen3ForCausalLM or
Qwen3MoeForCausalLM) as a Titan weights-only DCP checkpoint.

    python scripts/convert_from_hf.py Llama-3.1-8B llama31_8b_dcp -- --model.flavor 8B \\
        --model.tokenizer_path Llama-3.1-8B/original/tokenizer.model
    ./run_train.sh --model.flavor 8B --checkpoint.initial_load_path llama31_8b_dcp ...

Reads model.safetensors or the shards in model.safetensors.index.json through the same code as
--checkpoint.initial_load_in_hf (titan/checkpoint/hf_io.py), on one process: checks config.json (when present) and
every shard's header against the Titan flavor, undoes the rotate-half RoPE layout of q_proj/k_proj (and Qwen3's
q_norm/k_norm), stacks per-expert tensors, pads the embedding and output to the padded vocab with zero rows, and
saves {"model": state_dict} in float32 with torch.distributed.checkpoint.
Everything after `--` is a Titan flag; only --model.name, --model.flavor, --model.tokenizer_path,
--model.vocab_size_multiple_of and --moe.load_balance_coeff matter.
"""

import argparse
from pathlib import Path

from checkpoint_common import check_new_folder, checkpoint_parser, parse_model_shape, run_script
from titan.checkpoint.dcp import save_model_weights
from titan.checkpoint.hf_io import read_hf_weights
from titan.metrics.log import logger
from titan_flags import parse_with_titan_flags


def parse_cli() -> tuple[argparse.Namespace, list[str]]:
    parser = checkpoint_parser(__doc__)
    parser.add_argument("hf_folder", type=Path, help="Hugging Face folder with config.json and safetensors files")
    parser.add_argument("output_folder", type=Path, help="new folder for the DCP checkpoint")
    return parse_with_titan_flags(parser)


def main() -> None:
    cli, titan_flags = parse_cli()
    check_new_folder(cli.output_folder, "output_folder")
    model_cfg, args, tokenizer = parse_model_shape(titan_flags)
    # Titan keeps float32 weights (bf16 is a compute dtype), so a bf16 download is widened as it is read.
    state_dict = read_hf_weights(cli.hf_folder, args)
    save_model_weights(state_dict, cli.output_folder)
    logger.info(f"Wrote {len(state_dict)} float32 tensors of {model_cfg.flavor} from {cli.hf_folder} to "
                f"{cli.output_folder}; start a run from it with --checkpoint.initial_load_path {cli.output_folder}.")


if __name__ == "__main__":
    raise SystemExit(run_script(main))
