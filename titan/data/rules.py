"""The data's config rules (titan/config/rule.py says what a rule is): the tokenizer, dataset and template paths
exist, a mixture names each source once and replaces --training.dataset, and the [chat] fields apply to a run that
reads conversations, which block-causal attention keeps apart."""

import glob

from titan.config.job import Chat, Model, Training, Validation
from titan.config.mixture import MIXTURE_DATASETS, MixtureEntry, parse_mixture_entry
from titan.config.paths import resolve_path
from titan.config.rule import about_this_machine, fields_set
from titan.data.dataset import hub_dataset_problem


@about_this_machine
def check_tokenizer_path(model: Model) -> str | None:
    if resolve_path(model.tokenizer_path).is_file():
        return None
    return (f"--model.tokenizer_path {model.tokenizer_path!r} is not a file. Point it at a tiktoken-format "
            f"tokenizer such as tokenizers/titan_2256.tiktoken or Llama 3's tokenizer.model, or at a Hugging Face "
            f"tokenizer.json such as Qwen3's.")


@about_this_machine
def check_dataset_path(training: Training) -> str | None:
    return dataset_path_problem("--training", training.dataset, training.dataset_path)


@about_this_machine
def check_validation_dataset_path(validation: Validation) -> str | None:
    if not validation.enable:
        return None
    return dataset_path_problem("--validation", validation.dataset, validation.dataset_path)


def dataset_path_problem(section: str, dataset: str, dataset_path: str | None) -> str | None:
    """A missing or unmatched `{section}.dataset_path` for `dataset` (the path is unused for shipped)."""
    if dataset == "shipped":
        return None
    if dataset_path is None:
        return (f"{section}.dataset {dataset} needs {section}.dataset_path (files, a folder or a glob; a dataset name "
                f"for hf; a store's folder for prepared).")
    if dataset in ("text", "jsonl", "chat") and not path_matches(dataset_path):
        return f"{section}.dataset_path {dataset_path!r} matches no file or folder. Check the path or glob."
    if dataset == "hf" and not resolve_path(dataset_path).is_dir():
        return hub_dataset_problem(f"{section}.dataset", f"{section}.dataset_path", dataset_path)
    if dataset == "prepared" and not resolve_path(dataset_path).is_dir():
        return (f"{section}.dataset_path {dataset_path!r} is not a folder: --training.dataset prepared reads a token "
                f"store made by `python -m titan.data.prepare`. Check the path, or prepare the store first.")
    return None


def path_matches(path: str) -> bool:
    return resolve_path(path).exists() or bool(glob.glob(path))


@about_this_machine
def check_mixture_paths(training: Training) -> list[str]:
    problems = []
    for text in training.mixture:
        try:
            entry = parse_mixture_entry(text)
        except ValueError:
            continue  # check_mixture reports it
        if entry.dataset == "hf" and not resolve_path(str(entry.path)).is_dir():
            problems.append(hub_dataset_problem("--training.mixture", "entry", str(entry.path)))
        elif entry.path is not None and not path_matches(entry.path):
            problems.append(f"--training.mixture entry {text!r} has path {entry.path!r}, which matches no file or "
                            f"folder. Check the path or glob.")
    return problems


def check_mixture(training: Training) -> list[str]:
    t = training
    problems = []
    sources: list[str] = []
    for text in t.mixture:
        try:
            entry = parse_mixture_entry(text)
        except ValueError as bad:
            problems.append(f"--training.mixture entry {text!r} {bad}")
            continue
        if entry.source in sources:
            problems.append(f"--training.mixture lists {entry.source} twice. Give each source once, with the sum of "
                            f"its weights.")
        sources.append(entry.source)
    defaults = Training()
    if t.mixture and (t.dataset, t.dataset_path) != (defaults.dataset, defaults.dataset_path):
        given = f"--training.dataset {t.dataset}" + (f" --training.dataset_path {t.dataset_path!r}"
                                                     if t.dataset_path is not None else "")
        source = MixtureEntry(t.dataset, None if t.dataset == "shipped" else t.dataset_path, weight=1.0).source
        as_entry = f", or add it to the mixture as {source}=WEIGHT" if t.dataset in MIXTURE_DATASETS else ""
        problems.append(f"--training.mixture replaces --training.dataset and --training.dataset_path, but {given} is "
                        f"also given. Drop it{as_entry}.")
    return problems


def dataset_flags(training: Training, validation: Validation, dataset: str) -> list[str]:
    """The flags that name data of kind `dataset` (chat, prepared, ...), as the user gave them: a mixture's entries
    or --training.dataset, and --validation.dataset where validation runs."""
    flags = []
    if training.mixture:
        for text in training.mixture:
            try:
                if parse_mixture_entry(text).dataset == dataset:
                    flags.append(f"--training.mixture entry {text!r}")
            except ValueError:
                continue  # check_mixture reports it
    elif training.dataset == dataset:
        flags.append(f"--training.dataset {dataset}")
    if validation.enable and validation.dataset == dataset:
        flags.append(f"--validation.dataset {dataset}")
    return flags


def data_sources(training: Training) -> str:
    """What the run reads, for messages: "--training.dataset shipped", or the mixture."""
    if training.mixture:
        return f"--training.mixture {' '.join(training.mixture)}"
    return f"--training.dataset {training.dataset}"


def check_ignored_dataset_paths(training: Training, validation: Validation, chat: Chat) -> list[str]:
    """A path beside --training.dataset (or --validation.dataset) shipped reads nothing: the run would train on the
    shipped corpus while the user means their files. (Beside a mixture, check_mixture says so.)"""
    problems = []
    for section, settings, read in (("training", training, not training.mixture),
                                    ("validation", validation, validation.enable)):
        if not read or settings.dataset != "shipped" or settings.dataset_path is None:
            continue
        kind = "chat" if fields_set(chat) else "jsonl, text, chat, hf or prepared"
        problems.append(f"--{section}.dataset_path {settings.dataset_path!r} is given, but --{section}.dataset shipped "
                        f"reads the shipped corpus and ignores it. Add --{section}.dataset {kind} (what the path "
                        f"holds), or unset the path (--{section}.dataset_path None, where a TOML sets it).")
    return problems


def check_chat_fields_apply(training: Training, validation: Validation, chat: Chat) -> list[str]:
    """[chat] fields change how conversations are rendered (template_path, messages_field) and which of their tokens
    train (train_on, which also reads the roles of a prepared store of conversations): set in a run that reads no
    conversations, they are ignored."""
    given = fields_set(chat)
    if not given or dataset_flags(training, validation, "chat"):
        return []
    problems = []
    for name, value in given.items():
        if name == "train_on" and dataset_flags(training, validation, "prepared"):
            continue  # a prepared store may hold conversations, which train_on then selects tokens of
        stores = " or --training.dataset prepared with a store of them" if name == "train_on" else ""
        problems.append(f"--chat.{name} {value!r} only applies to conversations (--training.dataset chat, a chat: "
                        f"entry of --training.mixture or --validation.dataset chat{stores}), and this run reads none: "
                        f"it trains on {data_sources(training)}. Add --training.dataset chat with "
                        f"--training.dataset_path, or drop --chat.{name}.")
    return problems


def check_chat_attention(model: Model, training: Training, validation: Validation) -> str | None:
    """Conversations are packed several to a sequence: only block-causal attention keeps them apart."""
    flags = dataset_flags(training, validation, "chat")
    if not flags or model.attn_mask_type == "block_causal":
        return None
    return (f"{' and '.join(flags)} packs conversations into sequences, which needs --model.attn_mask_type "
            f"block_causal to keep each from reading the ones before it (got {model.attn_mask_type!r}). Use "
            f"block_causal.")


@about_this_machine
def check_chat_template_path(training: Training, validation: Validation, chat: Chat) -> str | None:
    path = chat.template_path
    if not path or not dataset_flags(training, validation, "chat") or resolve_path(path).is_file():
        return None
    return (f"--chat.template_path {path!r} is not a file. Point it at a Jinja chat template or a "
            f"tokenizer_config.json, or leave it empty for the tokenizer's.")
