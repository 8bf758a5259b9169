"""Titan's tokenizer as a Hugging Face tokenizer folder: tokenizer.json (the `tokenizers` library's format) and
tokenizer_config.json, written by hand so that the runtime needs neither `tokenizers` nor `transformers`.

`transformers.AutoTokenizer.from_pretrained(folder)(text)["input_ids"]` equals
`tokenizer.encode(text, bos=True, eos=False)`, like Llama 3's Hugging Face tokenizer:
- the BPE model holds the tiktoken ranks as ids and, as merges, every split of a token into two tokens
  (recover_merges says why);
- `ignore_merges` emits a pre-tokenized piece that is itself a token as that token, as tiktoken does before
  running BPE;
- the special tokens are special added tokens, and tokenizer_config.json sets `split_special_tokens`, so their
  strings inside text are encoded as plain text, as Titan's encode does. That flag is transformers'; a program
  that loads tokenizer.json with the `tokenizers` library alone must set `encode_special_tokens = True` itself.
The one difference: Titan cuts text into MAX_ENCODE_CHARS parts and runs of whitespace or non-whitespace into
MAX_RUN_CHARS parts before tiktoken sees them (titan/data/tokenizer.py, as Meta's Llama 3 tokenizer does) and
Hugging Face does not, so ids can differ at those cuts: only in texts or runs longer than that.

A tokenizer read from a tokenizer.json (titan/data/tokenizer_json.py) is exported as that file and its
tokenizer_config.json, unchanged: they are the tokenizer, chat template and added tokens' flags included, that its
users expect. Without a tokenizer_config.json beside it, one naming Titan's BOS and EOS is written.
"""

import json
from pathlib import Path
from typing import Any

from titan.data.tokenizer import BOS_TOKEN, EOS_TOKEN, LLAMA3_SPLIT_PATTERN, Tokenizer
from titan.data.tokenizer_json import TOKENIZER_CONFIG_FILE, byte_level


def write_hf_tokenizer(tokenizer: Tokenizer, folder: Path) -> list[Path]:
    """Write tokenizer.json and tokenizer_config.json into `folder` (created if missing); returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, content in tokenizer_files(tokenizer).items():
        path = folder / name
        path.write_bytes(content)
        paths.append(path)
    return paths


def tokenizer_files(tokenizer: Tokenizer) -> dict[str, bytes]:
    """File name -> content: the tokenizer.json files the tokenizer was read from, or ones built from its ranks."""
    if tokenizer.hf_json is None:
        return {"tokenizer.json": compact_json(build_tokenizer_json(tokenizer)),
                TOKENIZER_CONFIG_FILE: compact_json(build_tokenizer_config(BOS_TOKEN, EOS_TOKEN))}
    files = dict(tokenizer.hf_json.files)
    if TOKENIZER_CONFIG_FILE not in files:
        names = {token_id: name for name, token_id in tokenizer.special_tokens.items()}
        config = build_tokenizer_config(names.get(tokenizer.bos_id), names[tokenizer.eos_id])
        files[TOKENIZER_CONFIG_FILE] = compact_json(config)
    return files


def compact_json(content: dict[str, Any]) -> bytes:
    # Compact: indented, a 128000-rank tokenizer.json is 3x bigger and takes the json module 4x longer.
    return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def recover_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every pair of tokens whose bytes join into a token, ordered by the joined token's rank (different splits
    of one token by the ranks of their parts). Hugging Face's BPE merges the adjacent pair that comes first in
    this list, leftmost first; tiktoken merges any adjacent pair whose joined bytes are a token, lowest rank
    first, leftmost first: so both pick the same pair. (Were two different splits of one token adjacent at once,
    Hugging Face would take them in list order, not leftmost first; tests/test_hf_tokenizer.py finds no input
    where that changes the ids.) One merge per token, recovered by running BPE on its bytes with the lower ranks,
    would need that BPE to end in two tokens, which tiktoken files don't promise: most of that test's random
    vocabularies break it. Works on the byte-level names (one character per byte), which are what
    tokenizer.json lists."""
    merges = []
    for name, _ in sorted(vocab.items(), key=lambda item: item[1]):
        splits = []
        for cut in range(1, len(name)):
            left_rank = vocab.get(name[:cut])
            right_rank = vocab.get(name[cut:]) if left_rank is not None else None
            if right_rank is not None:
                splits.append((left_rank, right_rank, cut))
        merges.extend((name[:cut], name[cut:]) for _, _, cut in sorted(splits))
    return merges


def build_tokenizer_json(tokenizer: Tokenizer) -> dict[str, Any]:
    vocab = {byte_level(token): rank for token, rank in tokenizer.mergeable_ranks.items()}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for content, token_id in tokenizer.special_tokens.items()
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT_PATTERN}, "behavior": "Isolated", "invert": False},
            # use_regex False: the Split above already cut the text; this only maps bytes to the alphabet.
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ]},
        "post_processor": bos_template(tokenizer.bos_id),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
            "vocab": vocab,
            "merges": recover_merges(vocab),
        },
    }


def bos_template(bos_id: int) -> dict[str, Any]:
    """Prepend BOS to each sequence (a pair gets one per sequence, as Llama 3's tokenizer.json does)."""
    def sequence(name: str, type_id: int) -> list[dict[str, Any]]:
        return [{"SpecialToken": {"id": BOS_TOKEN, "type_id": type_id}},
                {"Sequence": {"id": name, "type_id": type_id}}]
    return {
        "type": "TemplateProcessing",
        "single": sequence("A", 0),
        "pair": sequence("A", 0) + sequence("B", 1),
        "special_tokens": {BOS_TOKEN: {"id": BOS_TOKEN, "ids": [bos_id], "tokens": [BOS_TOKEN]}},
    }


def build_tokenizer_config(bos_token: str | None, eos_token: str) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos_token,
        "eos_token": eos_token,
        "add_bos_token": bos_token is not None,
        "add_eos_token": False,
        "split_special_tokens": True,
        # True would rewrite " ." and " n't" while decoding, so decode would no longer invert encode.
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }
