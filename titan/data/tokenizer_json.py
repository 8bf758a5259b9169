"""Reads a Hugging Face tokenizer.json of the byte-level BPE kind (GPT-2, Llama 3, Qwen2 and Qwen3) into what
tiktoken needs, without the `tokenizers` library: mergeable ranks, the split regex and the special tokens, plus
the NFC normalizer and the BOS and EOS from the tokenizer_config.json beside it.

Why a vocab id can serve as tiktoken's rank: Hugging Face's BPE merges, in each pre-tokenized piece, the adjacent
pair listed first in `model.merges`; tiktoken merges the adjacent pair whose joined bytes have the lowest rank. These
files number their tokens in merge order: the 256 byte tokens first, then each merge's result the next id (the
`tokenizers` BpeTrainer appends every merge's token to the vocab as it learns it; tiktoken's own GPT-2 loader asserts
that GPT-2's ids are its merge order; Qwen's ids are the ranks of Qwen's original tiktoken file, and files converted
from tiktoken, such as Llama 3's, list every split of a token, grouped by that token's id). So the lowest-id joined
token is the first listed merge, and both pick the same pair. check_merge_order checks that the file is in that order
and that every token is some merge's result (tiktoken would otherwise merge into a token Hugging Face never forms).
tiktoken also emits a piece that is itself a token as that token, as Hugging Face does with `ignore_merges` (Llama 3's
files); files without it (Qwen2's, GPT-2's) get there by merging, since training made each token by merging its own
bytes. tests/test_tokenizer_json.py compares ids with the `tokenizers` library on varied text.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan.config.errors import ConfigError
from titan.metrics.log import logger

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# The regex of tokenizers' ByteLevel pre-tokenizer with use_regex (byte_level.rs): GPT-2's.
GPT2_SPLIT_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# What ends a document in these families' pretraining data: GPT-2's and Qwen's token, then Llama 3's.
END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>")
SUPPORTED = ("Titan reads byte-level BPE tokenizer.json files (the GPT-2, Llama 3, Qwen2, Qwen3 and DeepSeek-V3 kind: "
             "model BPE, a ByteLevel pre-tokenizer and decoder, optionally Split regexes before it and an NFC "
             "normalizer) and tiktoken files")


@dataclass(frozen=True)
class TrimOffsets:
    """A ByteLevel post-processor with trim_offsets: each token's (start, end) characters leave out the spaces at
    its edges (a space-only token gets an empty span), except, with add_prefix_space, the one space that
    add_prefix_space would have put before the first token."""

    add_prefix_space: bool


@dataclass(frozen=True)
class TokenizerJson:
    """What a tokenizer.json and the tokenizer_config.json beside it set beyond the mergeable ranks."""

    special_tokens: dict[str, int]
    """Every added token, by its own id."""
    split_pattern: str
    """The last regex that cuts text before BPE (what tiktoken applies)."""
    nfc: bool
    """Normalize text to NFC before encoding, as the file's normalizer does."""
    bos_id: int | None
    eos_id: int
    files: dict[str, bytes]
    """tokenizer.json and, when there is one, tokenizer_config.json, as read: Hugging Face exports carry them."""
    isolating_splits: tuple[str, ...] = ()
    """Regexes that cut text before split_pattern, one after the other, each match a piece of its own and the text
    between too (DeepSeek-V3's: digits in threes, then CJK runs)."""
    stripping_tokens: dict[str, tuple[bool, bool]] = field(default_factory=dict)
    """Added tokens that take in the whitespace beside them, by content: (lstrip, rstrip). A rendered chat template
    then has no whitespace token there (Phi-3's <|end|> and <|assistant|> set rstrip)."""
    trim_offsets: TrimOffsets | None = None
    """The ByteLevel post-processor's trim_offsets, when set: offsets leave out a token's edge spaces."""


def byte_level_table() -> dict[int, str]:
    """The byte-level alphabet of GPT-2, which tokenizers' ByteLevel pre-tokenizer and decoder use: BPE there runs
    on strings, so each byte becomes one printable character. Printable Latin-1 bytes stand for themselves; the
    other 68 take the code points from 256 up, in byte order. Keyed by code point, for str.translate."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    unprintable = [byte for byte in range(256) if byte not in printable]
    table = {byte: chr(byte) for byte in printable}
    table.update({byte: chr(256 + i) for i, byte in enumerate(unprintable)})
    return table


_BYTE_LEVEL = byte_level_table()
_FROM_BYTE_LEVEL = {ord(character): chr(byte) for byte, character in _BYTE_LEVEL.items()}


def byte_level(token: bytes) -> str:
    return token.decode("latin-1").translate(_BYTE_LEVEL)  # latin-1 maps byte b to code point b


def from_byte_level(name: str) -> bytes:
    """The bytes a byte-level token name stands for (every character must be in the alphabet)."""
    return name.translate(_FROM_BYTE_LEVEL).encode("latin-1")


def json_error(given: str, problem: str) -> ConfigError:
    return ConfigError(f"--model.tokenizer_path {given!r} {problem}. {SUPPORTED}.")


def read_tokenizer_json(resolved: Path, content: bytes, given: str) -> tuple[dict[bytes, int], TokenizerJson]:
    """The mergeable ranks (vocab ids) and the rest of the tokenizer.json `content` read from `resolved`, with BOS
    and EOS from the tokenizer_config.json beside it. Raises a ConfigError naming --model.tokenizer_path for any
    other kind of tokenizer."""
    try:
        tokenizer = json.loads(content)
    except (UnicodeDecodeError, ValueError) as err:
        raise json_error(given, f"starts like a tokenizer.json but is not valid JSON ({err})") from None
    if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("model"), dict):
        raise json_error(given, "is JSON without a tokenizer `model`: not a Hugging Face tokenizer.json")
    model = tokenizer["model"]
    check_bpe_model(model, given)
    *isolating_splits, split_pattern = read_split_patterns(tokenizer.get("pre_tokenizer"), given)
    nfc = read_normalizer(tokenizer.get("normalizer"), given)
    if (tokenizer.get("decoder") or {}).get("type") != "ByteLevel":
        raise json_error(given, f"has a {describe(tokenizer.get('decoder'))} decoder, not ByteLevel")
    try:
        added_tokens = tokenizer.get("added_tokens", [])
        special_tokens = {token["content"]: token["id"] for token in added_tokens}
    except (KeyError, TypeError):
        raise json_error(given, "has an added_tokens entry without content and id") from None
    stripping_tokens = {token["content"]: (bool(token.get("lstrip")), bool(token.get("rstrip")))
                        for token in added_tokens if token.get("lstrip") or token.get("rstrip")}
    ranks = read_ranks(model, special_tokens, given)
    config: dict[str, Any] = {}
    files = {"tokenizer.json": content}
    config_path = resolved.parent / TOKENIZER_CONFIG_FILE
    if config_path.is_file():
        config, files[TOKENIZER_CONFIG_FILE] = read_tokenizer_config(config_path, given)
    bos_id, eos_id = read_bos_eos(config, special_tokens, given, template_bos(tokenizer.get("post_processor")))
    return ranks, TokenizerJson(special_tokens, split_pattern, nfc, bos_id, eos_id, files, tuple(isolating_splits),
                                stripping_tokens, read_trim_offsets(tokenizer.get("post_processor")))


def describe(component: Any) -> str:
    return repr(component["type"]) if isinstance(component, dict) and "type" in component else "missing"


def check_bpe_model(model: dict[str, Any], given: str) -> None:
    """A BPE model on byte-level strings: not WordPiece or Unigram, and not sentencepiece's BPE (Llama 2,
    Mistral), whose byte fallback and word markers tiktoken has no equivalent for."""
    if model.get("type") != "BPE":
        raise json_error(given, f"is a {describe(model)} tokenizer.json")
    unsupported = [field for field in ("byte_fallback", "continuing_subword_prefix", "end_of_word_suffix", "dropout")
                   if model.get(field)]
    if unsupported:
        raise json_error(given, f"is a BPE tokenizer.json with {', '.join(unsupported)} set (a sentencepiece-style "
                                f"or subword-marked BPE, not byte-level)")


def pre_tokenizer_steps(pre_tokenizer: dict[str, Any] | None) -> list[dict[str, Any]]:
    if pre_tokenizer is None:
        return []
    if pre_tokenizer.get("type") == "Sequence":
        return list(pre_tokenizer.get("pretokenizers", []))
    return [pre_tokenizer]


def read_split_patterns(pre_tokenizer: dict[str, Any] | None, given: str) -> list[str]:
    """The regexes that cut text before BPE, in order: Splits' (one for Llama 3 and Qwen2, three for DeepSeek-V3)
    followed by a ByteLevel that only maps bytes, or GPT-2's, which a ByteLevel with use_regex applies itself."""
    steps = pre_tokenizer_steps(pre_tokenizer)
    types = [step.get("type") for step in steps]
    byte_level_step = steps[-1] if types and types[-1] == "ByteLevel" else None
    if byte_level_step is None or byte_level_step.get("add_prefix_space"):
        raise json_error(given, f"has pre-tokenizers {types} (needs a ByteLevel without add_prefix_space last): "
                                f"not a byte-level BPE of the supported kind")
    if types == ["ByteLevel"] and byte_level_step.get("use_regex", True):
        return [GPT2_SPLIT_PATTERN]
    splits = steps[:-1]
    if not splits or set(types[:-1]) != {"Split"} or byte_level_step.get("use_regex", True):
        raise json_error(given, f"has pre-tokenizers {types} with the ByteLevel's use_regex "
                                f"{byte_level_step.get('use_regex', True)}; supported are a ByteLevel with use_regex "
                                f"alone, or Splits then a ByteLevel without it")
    for split in splits:
        if "Regex" not in split.get("pattern", {}) or split.get("behavior") != "Isolated" or split.get("invert"):
            raise json_error(given, f"has a Split pre-tokenizer with pattern {split.get('pattern')!r}, behavior "
                                    f"{split.get('behavior')!r} and invert {split.get('invert')!r}; only a Regex with "
                                    f"behavior Isolated and invert false cuts text as tiktoken does")
    return [split["pattern"]["Regex"] for split in splits]


def read_trim_offsets(post_processor: dict[str, Any] | None) -> TrimOffsets | None:
    """The trim_offsets of a ByteLevel post-processor, alone or in a Sequence (Llama 3's files put one before their
    TemplateProcessing). Other post-processors add special tokens, which Titan's chat rendering does not ask for
    (transformers' apply_chat_template encodes without them), and leave offsets as they are."""
    steps = [] if post_processor is None else (post_processor.get("processors", []) if post_processor.get("type") ==
                                               "Sequence" else [post_processor])
    for step in steps:
        if step.get("type") == "ByteLevel" and step.get("trim_offsets"):
            return TrimOffsets(bool(step.get("add_prefix_space")))
    return None


def read_normalizer(normalizer: dict[str, Any] | None, given: str) -> bool:
    """True for Qwen's NFC normalizer, False for none; anything else changes text in ways Titan doesn't."""
    if normalizer is None:
        return False
    if normalizer.get("type") != "NFC":
        raise json_error(given, f"has a {describe(normalizer)} normalizer (only NFC, or none, is supported)")
    return True


def read_ranks(model: dict[str, Any], special_tokens: dict[str, int], given: str) -> dict[bytes, int]:
    """`model.vocab` as bytes -> id, without the added tokens some files also list there (GPT-2's <|endoftext|>),
    checked for what tiktoken needs: every single byte, distinct ids, and merges in id order."""
    vocab = {name: token_id for name, token_id in model.get("vocab", {}).items()
             if special_tokens.get(name) != token_id}
    foreign = set("".join(vocab)) - set(_BYTE_LEVEL.values())
    if foreign:
        raise json_error(given, f"has vocab entries outside the byte-level alphabet (such as {sorted(foreign)[0]!r}): "
                                f"not a byte-level BPE")
    ranks = {from_byte_level(name): token_id for name, token_id in vocab.items()}
    missing = [byte for byte in range(256) if bytes([byte]) not in ranks]
    if missing:
        raise json_error(given, f"has no token for {len(missing)} of the 256 single bytes (first: {missing[0]}), so "
                                f"some text can't be encoded")
    ids = [*ranks.values(), *special_tokens.values()]
    if len(set(ids)) != len(ids):
        raise json_error(given, "gives one id to two tokens (in model.vocab or added_tokens)")
    check_merge_order(model.get("merges", []), vocab, given)
    return ranks


def check_merge_order(merges: list[Any], vocab: dict[str, int], given: str) -> None:
    """The module docstring's condition for rank = id: each merge's token has an id no lower than the previous
    merge's, and every token longer than a byte is some merge's result."""
    merged: set[str] = set()
    previous_id = -1
    for index, merge in enumerate(merges):
        try:
            left, right = merge if isinstance(merge, list) else merge.split(" ")  # newer files write pairs as lists
        except (ValueError, AttributeError):
            raise json_error(given, f"has merge {index} {merge!r}, which is not a pair of tokens") from None
        token_id = vocab.get(left + right)
        if token_id is None or token_id < previous_id:
            raise json_error(given, f"has merge {index} ({left!r}, {right!r}) "
                                    f"{'joining into no vocab token' if token_id is None else 'out of id order'}; "
                                    f"Titan encodes by vocab id, which matches Hugging Face's merges only when ids "
                                    f"follow the merge order")
        merged.add(left + right)
        previous_id = token_id
    unreachable = [name for name in vocab if len(name) > 1 and name not in merged]  # one character a byte
    if unreachable:
        raise json_error(given, f"has {len(unreachable)} multi-byte vocab tokens that no merge forms (such as "
                                f"{unreachable[0]!r}); Titan would emit them where Hugging Face can't")


def read_tokenizer_config(path: Path, given: str) -> tuple[dict[str, Any], bytes]:
    """The tokenizer_config.json at `path`, parsed and as read."""
    try:
        content = path.read_bytes()
        config = json.loads(content)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}, beside --model.tokenizer_path {given!r}, can't be read as JSON ({err}). Fix or "
                          f"remove it (without it: no BOS, and EOS is the end-of-text token).") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}, beside --model.tokenizer_path {given!r}, is not a JSON object. Fix or remove it.")
    return config, content


def token_content(value: Any) -> str | None:
    """A tokenizer_config.json token field: a string, an AddedToken dict with "content", or null."""
    return value.get("content") if isinstance(value, dict) else value


def template_bos(post_processor: dict[str, Any] | None) -> str | None:
    """The special token a TemplateProcessing post-processor (alone or in a Sequence: Llama 3's) puts before a single
    text, which is how a tokenizer.json adds its BOS; None if it adds none."""
    steps = [] if post_processor is None else (post_processor.get("processors", []) if post_processor.get("type") ==
                                               "Sequence" else [post_processor])
    for step in steps:
        if step.get("type") == "TemplateProcessing" and step.get("single"):
            first = step["single"][0]
            if isinstance(first, dict) and "SpecialToken" in first:
                return first["SpecialToken"].get("id")
    return None


def read_bos_eos(config: dict[str, Any], special_tokens: dict[str, int], given: str,
                 template_bos_name: str | None) -> tuple[int | None, int]:
    """BOS: tokenizer_config.json's bos_token where the tokenizer adds it, as transformers does: the config sets
    add_bos_token true (DeepSeek-V3's), or leaves it out and the tokenizer.json's template puts that token first
    (Llama 3's, `template_bos_name`); not where the config only names it (GPT-OSS's <|startoftext|>, which its
    tokenizer never adds), nor where it is also the EOS (a second separator between documents); none without a
    config. EOS: the file's end-of-text token when it has one, else the config's eos_token. A pretraining document
    ends at end of text; the instruct models' configs name their chat turn's end instead (Qwen3's <|im_end|>, Llama
    3's <|eot_id|>, GPT-OSS's <|return|>), which is where chat generation stops, not what separates the documents
    these models were pretrained on."""
    def lookup(field: str, name: str) -> int:
        if name not in special_tokens:
            raise ConfigError(f"{TOKENIZER_CONFIG_FILE} beside --model.tokenizer_path {given!r} names {field} "
                              f"{name!r}, which is not one of the tokenizer.json's added_tokens. Fix the config's "
                              f"{field}.")
        return special_tokens[name]

    configured_eos = token_content(config.get("eos_token"))
    eos_name = next((name for name in END_OF_TEXT_TOKENS if name in special_tokens), configured_eos)
    if eos_name is None:
        raise ConfigError(f"--model.tokenizer_path {given!r} has no EOS: no {' or '.join(END_OF_TEXT_TOKENS)} among "
                          f"its added_tokens and no eos_token in a {TOKENIZER_CONFIG_FILE} beside it. Titan ends "
                          f"every document with EOS: set eos_token in {TOKENIZER_CONFIG_FILE} to the added token "
                          f"that ends a document.")
    eos_id = lookup("eos_token", eos_name)
    if configured_eos not in (None, eos_name):
        logger.info(f"Tokenizer: EOS is {eos_name} ({eos_id}), the end of a pretraining document, not "
                    f"{TOKENIZER_CONFIG_FILE}'s eos_token {configured_eos} (a chat turn's end)")
    bos_name = token_content(config.get("bos_token"))
    if bos_name is None:
        return None, eos_id
    bos_id = lookup("bos_token", bos_name)  # a name the tokenizer lacks is a broken config, added or not
    added = config["add_bos_token"] if "add_bos_token" in config else bos_name == template_bos_name
    return (bos_id if added and bos_name != eos_name else None), eos_id
