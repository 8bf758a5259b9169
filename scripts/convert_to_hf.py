"""Export a Titan DCP checkpoint as a Hugging Face folder (safetensors + config.json): LlamaForCausalLM, or with
--model.name qwen3 Qwen3ForCausalLM or Qwen3MoeForCausalLM.

    python scripts/convert_to_hf.py outputs/debug_model/checkpoint/step-100 hf_debug
    python scripts/convert_to_hf.py <dump_folder>/checkpoint/step-5000 hf_8b --dtype bfloat16 -- \\
        --job.config_file <dump_folder>/config.toml

Reads only the model tensors of the step folder (a full checkpoint or a weights-only one) on one process and writes
them through the same code as --checkpoint.last_save_in_hf (titan/checkpoint/hf_io.py): safetensors shards with their
index, config.json and the tokenizer files. Everything after `--` is a Titan flag; only --model.name,
--model.flavor, --model.tokenizer_path, --model.vocab_size_multiple_of and --moe.load_balance_coeff matter. The
folder loads with transformers' AutoModelForCausalLM.from_pretrained(folder) and AutoTokenizer.from_pretrained(folder).
"""

import argparse
from pathlib import Path

from checkpoint_common import check_new_folder, checkpoint_parser, parse_model_shape, read_checked_weights, run_script
from titan.checkpoint.hf_io import DEFAULT_MAX_SHARD_BYTES, save_hf
from titan.config.dtypes import DTYPES
from titan.metrics.log import logger
from titan_flags import parse_with_titan_flags


def parse_cli() -> tuple[argparse.Namespace, list[str]]:
    parser = checkpoint_parser(__doc__)
    parser.add_argument("step_folder", help="Titan DCP step folder, e.g. <dump_folder>/checkpoint/step-20, or its URL "
                                             "(s3://bucket/run/step-20)")
    parser.add_argument("output_folder", type=Path, help="new folder for the Hugging Face files")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="dtype of the exported weights (default: bfloat16, as Meta publishes Llama 3)")
    parser.add_argument("--max_shard_bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES,
                        help="largest safetensors file; more weights than this are split into shards listed "
                             "in model.safetensors.index.json (default: 5e9, transformers' default)")
    return parse_with_titan_flags(parser)


def main() -> None:
    cli, titan_flags = parse_cli()
    check_new_folder(cli.output_folder, "output_folder")
    model_cfg, args, tokenizer = parse_model_shape(titan_flags)
    dtype = DTYPES[cli.dtype]
    weights = read_checked_weights(cli.step_folder, args)
    save_hf(weights, cli.output_folder, args, dtype, tokenizer, cli.max_shard_bytes)
    logger.info(f"Wrote {len(weights)} {cli.dtype} tensors of {model_cfg.flavor} from {cli.step_folder} to "
                f"{cli.output_folder}: {', '.join(sorted(path.name for path in cli.output_folder.iterdir()))}.")


if __name__ == "__main__":
    raise SystemExit(run_script(main))
