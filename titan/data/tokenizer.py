"""Byte-level BPE tokenizer in tiktoken format: Llama 3's tokenizer.model or one trained by
scripts/train_tokenizer.py (such as the shipped tokenizers/titan_2256.tiktoken)."""

import base64
import binascii
import re
from collections.abc import Iterator
from pathlib import Path

import tiktoken

from titan.config.errors import ConfigError
from titan.config.paths import resolve_path

SHIPPED_TOKENIZER = "tokenizers/titan_2256.tiktoken"

# Llama 3's pre-tokenization regex (the GPT-4 cl100k pattern), from Meta's llama3 tokenizer.py.
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
LLAMA3_NUM_RANKS = 128_000
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
TITAN_SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)  # what any tokenizer other than Llama 3's gets after its ranks

# tiktoken's regex and BPE get slow (superlinear) on very long inputs and on long runs of only whitespace or
# only non-whitespace; Meta's llama3 tokenizer.py cuts inputs at these same limits.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
_RUN = re.compile(r"\s+|\S+")

TIKTOKEN_FORMAT = "one `<base64 token bytes> <rank>` pair per line, ranks 0..N-1 (like Llama 3's tokenizer.model)"


def llama3_special_tokens() -> list[str]:
    """Llama 3.1's 256 special tokens in id order; they take ids 128000..128255 after the 128000 ranks."""
    named = [
        BOS_TOKEN, EOS_TOKEN, "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
        "<|eot_id|>", "<|python_tag|>",
    ]
    return named + [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(named))]


def special_tokens_for(num_ranks: int) -> dict[str, int]:
    """Special token ids for a file with `num_ranks` ranks: Llama 3's full set when the file is Llama 3's
    (so ids match Meta's), otherwise just BOS and EOS right after the ranks."""
    names = llama3_special_tokens() if num_ranks == LLAMA3_NUM_RANKS else list(TITAN_SPECIAL_TOKENS)
    return {name: num_ranks + i for i, name in enumerate(names)}


class Tokenizer:
    """Encodes any text to ids and back. Special-token strings inside text are encoded as plain text."""

    def __init__(self, mergeable_ranks: dict[bytes, int], name: str) -> None:
        special_tokens = special_tokens_for(len(mergeable_ranks))
        self._encoding = tiktoken.Encoding(
            name=name, pat_str=LLAMA3_SPLIT_PATTERN, mergeable_ranks=mergeable_ranks, special_tokens=special_tokens
        )
        # Public so that exporters (titan/data/hf_tokenizer.py) can rebuild the same tokenizer in other formats.
        self.mergeable_ranks: dict[bytes, int] = mergeable_ranks
        self.special_tokens: dict[str, int] = special_tokens
        self.bos_id: int = special_tokens[BOS_TOKEN]
        self.eos_id: int = special_tokens[EOS_TOKEN]
        self.vocab_size: int = len(mergeable_ranks) + len(special_tokens)

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        ids = [self.bos_id] if bos else []
        for piece in tiktoken_pieces(text):
            ids.extend(self._encoding.encode_ordinary(piece))
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode(ids)


def tiktoken_pieces(text: str) -> Iterator[str]:
    """`text` cut into pieces tiktoken encodes in linear time: at most MAX_ENCODE_CHARS each, and no run of
    whitespace or non-whitespace longer than MAX_RUN_CHARS. Joined, the pieces are `text`."""
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        part = text[start : start + MAX_ENCODE_CHARS]
        if len(part) <= MAX_RUN_CHARS:
            yield part
            continue
        cut = 0
        for run in _RUN.finditer(part):
            for end in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield part[cut:end]
                cut = end
        yield part[cut:]


def build_tokenizer(path: str) -> Tokenizer:
    """Load the tiktoken file at `path` (relative: to the working directory, else to the project root)."""
    resolved = resolve_path(path)
    if not resolved.is_file():
        raise ConfigError(f"--model.tokenizer_path {path!r} is not a file (looked in the working directory and the "
                          f"project root). Point it at a tiktoken file such as {SHIPPED_TOKENIZER} or Llama 3's "
                          f"original/tokenizer.model.")
    return Tokenizer(read_tiktoken_ranks(resolved, path), name=resolved.stem)


def read_tiktoken_ranks(resolved: Path, given: str) -> dict[bytes, int]:
    """The mergeable ranks in a tiktoken file. Parsed here rather than by tiktoken.load.load_tiktoken_bpe, which
    caches files by path under /tmp and so would keep serving a stale copy after a tokenizer is retrained."""
    try:
        lines = resolved.read_bytes().splitlines()
    except OSError as err:
        raise ConfigError(f"--model.tokenizer_path {given!r} can't be read ({err.strerror}). Check the file's "
                          f"permissions.") from err
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (IndexError, ValueError, binascii.Error):
            raise ConfigError(f"--model.tokenizer_path {given!r} is not a tiktoken file: line {line_number} is not "
                              f"`<base64 token bytes> <rank>`. Expected {TIKTOKEN_FORMAT}; Hugging Face "
                              f"tokenizer.json files are not supported.") from None
        if len(fields) != 2 or token in ranks:
            raise ConfigError(f"--model.tokenizer_path {given!r} is not a tiktoken file: line {line_number} has "
                              f"{'extra fields' if len(fields) != 2 else 'a token listed twice'}. "
                              f"Expected {TIKTOKEN_FORMAT}.")
        ranks[token] = rank
    check_ranks(ranks, given)
    return ranks


def check_ranks(ranks: dict[bytes, int], given: str) -> None:
    """Ids must be dense (special tokens go right after them) and cover every byte (so any text encodes)."""
    if not ranks:
        raise ConfigError(f"--model.tokenizer_path {given!r} is empty. Expected {TIKTOKEN_FORMAT}.")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ConfigError(f"--model.tokenizer_path {given!r} is not a usable tiktoken file: its {len(ranks)} ranks "
                          f"are not exactly 0..{len(ranks) - 1}. Expected {TIKTOKEN_FORMAT}.")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ConfigError(f"--model.tokenizer_path {given!r} is not a byte-level BPE tokenizer: {len(missing)} of the "
                          f"256 single bytes have no rank (first: {missing[0]}). Train one with "
                          f"scripts/train_tokenizer.py or use Llama 3's tokenizer.model.")
