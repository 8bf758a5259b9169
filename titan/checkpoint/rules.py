"""The checkpoints' config rules (titan/config/rule.py says what a rule is): the parts and paths a run loads, the
storage backends its URLs need, and a Hugging Face class for the flavor an import or export names, checked before
any training that a failed save at the end would waste."""

import os

from titan.config.job import CHECKPOINT_PARTS, Checkpoint, Model
from titan.config.paths import is_url, missing_backend
from titan.config.rule import about_this_machine, flavor_args
from titan.hardware import Accelerator
from titan.models.families import FAMILIES


def check_checkpoint(checkpoint: Checkpoint, world_size: int) -> list[str]:
    ckpt = checkpoint
    problems = []
    urls = [(name, url) for name, url in (("folder", ckpt.folder), ("initial_load_path", ckpt.initial_load_path))
            if url is not None and is_url(url)]
    unknown = [part for part in ckpt.exclude_from_loading if part not in CHECKPOINT_PARTS]
    if unknown:
        problems.append(f"--checkpoint.exclude_from_loading has unknown part(s) {', '.join(map(repr, unknown))}. "
                        f"Parts: {', '.join(CHECKPOINT_PARTS)}.")
    if ckpt.create_seed_checkpoint and (world_size != 1 or not ckpt.enable):
        problems.append(f"--checkpoint.create_seed_checkpoint writes the initial weights from one process into "
                        f"--checkpoint.folder: run it with --checkpoint.enable and NGPU=1 "
                        f"(world size is {world_size}).")
    if ckpt.initial_load_in_hf and ckpt.initial_load_path is None:
        problems.append("--checkpoint.initial_load_in_hf needs --checkpoint.initial_load_path, the Hugging Face folder "
                        "to load.")
    if ckpt.last_save_in_hf and not ckpt.enable:
        problems.append("--checkpoint.last_save_in_hf exports the last step's checkpoint, but --checkpoint.enable is "
                        "off, so no checkpoint is written. Add --checkpoint.enable.")
    problems += [f"--checkpoint.{name} {url!r}: {problem}" for name, url in urls if (problem := missing_backend(url))]
    initial = ckpt.initial_load_path
    if initial is not None and is_url(initial) and ckpt.initial_load_in_hf:
        problems.append(f"--checkpoint.initial_load_path {initial!r} with --checkpoint.initial_load_in_hf: "
                        f"Hugging Face folders are read from a local (or shared) filesystem only. Copy it there first "
                        f"(aws s3 cp --recursive, gcloud storage cp -r) and pass that folder.")
    return problems


@about_this_machine
def check_initial_load_path(checkpoint: Checkpoint) -> str | None:
    initial = checkpoint.initial_load_path
    if initial is None or is_url(initial) or os.path.isdir(initial):
        return None
    return (f"--checkpoint.initial_load_path {initial!r} is not a folder. Give a checkpoint step folder (e.g. "
            f"outputs/checkpoint/step-1000, or s3://bucket/run/step-1000), a run's checkpoint folder (its latest "
            f"step: outputs/debug_model/checkpoint after `./run_train.sh --checkpoint.enable`) or a Hugging Face "
            f"model folder.")


def check_pinned_memory_checkpoint(checkpoint: Checkpoint, accelerator: Accelerator) -> str | None:
    if checkpoint.async_mode == "async_with_pinned_mem" and not accelerator.is_cuda:
        return ("--checkpoint.async_mode async_with_pinned_mem copies device tensors into pinned host memory, which "
                "needs CUDA GPUs. Use --checkpoint.async_mode async on this machine.")
    return None


def check_hugging_face_class(model: Model, checkpoint: Checkpoint) -> str | None:
    """An export (or import) of a flavor that no transformers class holds would fail at the last save, after all of
    the training, having replaced the last checkpoint (or at the start, for the import): refused now instead."""
    args = flavor_args(model)
    flags = [flag for flag, on in (("--checkpoint.last_save_in_hf", checkpoint.last_save_in_hf),
                                   ("--checkpoint.initial_load_in_hf", checkpoint.initial_load_in_hf)) if on]
    if not flags or args is None:
        return None
    try:
        FAMILIES[model.name].hf_mapping(args)
    except ValueError as error:
        return (f"{' and '.join(flags)} {'needs' if len(flags) == 1 else 'need'} a Hugging Face class for "
                f"--model.name {model.name} --model.flavor {model.flavor}, and there is none: {error} Or drop "
                f"{' and '.join(flags)}.")
    return None
