"""Byte-level BPE tokenizer on tiktoken, read from a tiktoken file (Llama 3's tokenizer.model or one trained by
scripts/train_tokenizer.py, such as the shipped tokenizers/titan_2256.tiktoken) or from a Hugging Face
tokenizer.json of the same kind (GPT-2, Llama 3, Qwen2 and Qwen3: titan/data/tokenizer_json.py)."""

import base64
import binascii
import functools
import re
import unicodedata
from collections.abc import Iterator

import numpy as np
import regex
import tiktoken

from titan.config.errors import ConfigError
from titan.config.paths import resolve_path
from titan.data.tokenizer_json import TokenizerJson, read_tokenizer_json

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
WHOLE_PIECE = r"[\s\S]+"
"""tiktoken's regex where the pieces are cut before it: each piece one match."""

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
    """Encodes any text to ids and back. Special-token strings inside text are encoded as plain text: documents
    get special tokens only where Titan puts them (BOS, EOS), never from what they contain."""

    def __init__(self, mergeable_ranks: dict[bytes, int], name: str, hf_json: TokenizerJson | None = None) -> None:
        """`mergeable_ranks` of a tiktoken file get Llama 3's regex and special tokens (special_tokens_for);
        `hf_json` brings a tokenizer.json's instead."""
        special_tokens = special_tokens_for(len(mergeable_ranks)) if hf_json is None else hf_json.special_tokens
        # tiktoken cuts text with one regex and drops what no match covers. A file whose text passes several regexes
        # in turn, each keeping the text between its matches as pieces too, is cut here, whole, and tiktoken
        # encodes each piece as one.
        splits = hf_json.isolating_splits + (hf_json.split_pattern,) if hf_json is not None else ()
        self._splits = [regex.compile(pattern) for pattern in splits] if len(splits) > 1 else []
        self._encoding = tiktoken.Encoding(
            name=name, pat_str=WHOLE_PIECE if self._splits else
            LLAMA3_SPLIT_PATTERN if hf_json is None else hf_json.split_pattern,
            mergeable_ranks=mergeable_ranks, special_tokens=special_tokens,
        )
        # Public so that exporters (titan/data/hf_tokenizer.py) can rebuild the same tokenizer in other formats, or
        # carry hf_json's files, and token stores can fingerprint it (titan/data/store.py).
        self.mergeable_ranks: dict[bytes, int] = mergeable_ranks
        self.special_tokens: dict[str, int] = special_tokens
        self.hf_json: TokenizerJson | None = hf_json
        self.bos_id: int | None = special_tokens[BOS_TOKEN] if hf_json is None else hf_json.bos_id
        self.eos_id: int = special_tokens[EOS_TOKEN] if hf_json is None else hf_json.eos_id
        # The highest id + 1: a tokenizer.json's ids may leave gaps.
        self.vocab_size: int = max(max(mergeable_ranks.values()), max(special_tokens.values())) + 1
        self.path: str | None = None
        """--model.tokenizer_path, for a tokenizer read from a file (build_tokenizer): where its chat template is."""

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        """`text`'s ids, after BOS when `bos` and the tokenizer has one, and before EOS when `eos`."""
        ids = [self.bos_id] if bos and self.bos_id is not None else []
        if self.hf_json is not None and self.hf_json.nfc:
            text = unicodedata.normalize("NFC", text)
        for piece in tiktoken_pieces(text):
            for part in isolated_pieces(piece, self._splits):
                ids.extend(self._encoding.encode_ordinary(part))
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode(ids)

    def encode_rendered(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of a rendered chat template, and each one's (start, end) characters in `text`. Unlike encode, the
        special tokens' strings in `text` are those tokens, as transformers' apply_chat_template encodes them
        (the template writes them as strings); what lies between them is encoded as encode encodes text."""
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            self._extend_ordinary(text[start:match.start()], start, ids, offsets)
            ids.append(self.special_tokens[match.group()])
            offsets.append((match.start(), match.end()))
            start = match.end()
        self._extend_ordinary(text[start:], start, ids, offsets)
        return ids, offsets

    @functools.cached_property
    def _special_pattern(self) -> "re.Pattern[str]":
        # Longest first, so that one special token's string inside another's matches as the longer one, as
        # Hugging Face's added-token matching does.
        names = sorted(self.special_tokens, key=len, reverse=True)
        return re.compile("|".join(re.escape(name) for name in names))

    def _extend_ordinary(self, text: str, first_char: int, ids: list[int], offsets: list[tuple[int, int]]) -> None:
        """Append the ids of plain `text`, which starts at character `first_char` of the rendered text, and their
        (start, end) characters there."""
        if not text:
            return
        text_ids = self.encode(text, bos=False, eos=False)
        nfc = self.hf_json is not None and self.hf_json.nfc
        normalized, origins = nfc_origins(text) if nfc else (text, None)
        starts, ends = token_char_spans(self.token_byte_lengths[text_ids], normalized)
        if origins is not None:  # characters of the NFC text back to those of `text`
            starts, ends = origins[0][starts], origins[1][ends - 1]
        ids.extend(text_ids)
        offsets.extend(zip((starts + first_char).tolist(), (ends + first_char).tolist()))

    @functools.cached_property
    def token_byte_lengths(self) -> np.ndarray:
        """How many bytes each id decodes to, indexed by id (0 for ids no token has)."""
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for token, rank in self.mergeable_ranks.items():
            lengths[rank] = len(token)
        for name, token_id in self.special_tokens.items():
            lengths[token_id] = len(name.encode("utf-8"))
        return lengths


def token_char_spans(byte_lengths: np.ndarray, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) characters in `text` of tokens that decode to `byte_lengths` bytes each and together to `text`'s
    UTF-8: a token that starts or ends inside a character's bytes covers that character, as Hugging Face's offsets
    do."""
    code_points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    char_bytes = 1 + (code_points >= 0x80) + (code_points >= 0x800) + (code_points >= 0x10000)
    char_of_byte = np.repeat(np.arange(len(text)), char_bytes)
    token_ends = np.cumsum(byte_lengths)
    return char_of_byte[token_ends - byte_lengths], char_of_byte[token_ends - 1] + 1


def nfc_origins(text: str) -> tuple[str, tuple[np.ndarray, np.ndarray] | None]:
    """`text` in NFC and, when that changes it, the (start, end) characters of `text` each of its characters comes
    from: the grapheme cluster it was composed from (NFC composes within one), or all of `text` where composing the
    clusters one by one would give another text."""
    normalized = unicodedata.normalize("NFC", text)
    if normalized == text:
        return text, None
    starts: list[int] = []
    ends: list[int] = []
    pieces = []
    for cluster in regex.finditer(r"\X", text):
        piece = unicodedata.normalize("NFC", cluster.group())
        pieces.append(piece)
        starts.extend([cluster.start()] * len(piece))
        ends.extend([cluster.end()] * len(piece))
    if "".join(pieces) != normalized:
        return normalized, (np.zeros(len(normalized), dtype=np.int64), np.full(len(normalized), len(text)))
    return normalized, (np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64))


def isolated_pieces(text: str, splits: list[regex.Pattern]) -> list[str]:
    """`text` cut by each regex of `splits` in turn, as Hugging Face's Split pre-tokenizer with behavior Isolated
    cuts: every match a piece, and every stretch between matches a piece too. No splits: the text whole."""
    pieces = [text]
    for split in splits:
        cut: list[str] = []
        for piece in pieces:
            start = 0
            for match in split.finditer(piece):
                if match.start() > start:
                    cut.append(piece[start:match.start()])
                if match.end() > match.start():
                    cut.append(match.group())
                start = max(start, match.end())
            if start < len(piece):
                cut.append(piece[start:])
        pieces = cut
    return pieces


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
    """Load the tiktoken file or Hugging Face tokenizer.json at `path` (relative: to the working directory, else to
    the project root). A file whose text starts with `{` is a tokenizer.json, whatever its name: a tiktoken line
    starts with base64."""
    resolved = resolve_path(path)
    if not resolved.is_file():
        raise ConfigError(f"--model.tokenizer_path {path!r} is not a file (looked in the working directory and the "
                          f"project root). Point it at a tiktoken file such as {SHIPPED_TOKENIZER} or Llama 3's "
                          f"original/tokenizer.model, or at a Hugging Face tokenizer.json such as Qwen3's.")
    try:
        content = resolved.read_bytes()
    except OSError as err:
        raise ConfigError(f"--model.tokenizer_path {path!r} can't be read ({err.strerror}). Check the file's "
                          f"permissions.") from err
    if content.lstrip().startswith(b"{"):
        ranks, hf_json = read_tokenizer_json(resolved, content, path)
        tokenizer = Tokenizer(ranks, name=resolved.stem, hf_json=hf_json)
    else:
        tokenizer = Tokenizer(read_tiktoken_ranks(content, path), name=resolved.stem)
    tokenizer.path = path
    return tokenizer


def read_tiktoken_ranks(content: bytes, given: str) -> dict[bytes, int]:
    """The mergeable ranks in a tiktoken file's `content`. Parsed here rather than by
    tiktoken.load.load_tiktoken_bpe, which caches files by path under /tmp and so would keep serving a stale copy
    after a tokenizer is retrained."""
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (IndexError, ValueError, binascii.Error):
            raise ConfigError(f"--model.tokenizer_path {given!r} is not a tiktoken file: line {line_number} is not "
                              f"`<base64 token bytes> <rank>`. Expected {TIKTOKEN_FORMAT}, or a Hugging Face "
                              f"tokenizer.json.") from None
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
