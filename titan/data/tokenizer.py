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
# What Rust's char::is_whitespace, str::trim_start and str::trim_end take for whitespace, which tokenizers uses for
# lstrip, rstrip and trim_offsets: Unicode's White_Space property (Python's str.isspace also takes U+001C-U+001F).
WHITE_SPACE = "\t\n\v\f\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
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
        """The ids of a rendered chat template, and each one's (start, end) characters in `text`, as the `tokenizers`
        library gives them to transformers' apply_chat_template. Unlike encode, the special tokens' strings in
        `text` are those tokens (the template writes them as strings), each taking in the whitespace beside it
        where tokenizer.json's lstrip or rstrip says so; what lies between them is encoded as encode encodes
        text."""
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        special: list[int] = []
        start = 0
        for token_start, token_end, name in self._special_matches(text):
            self._extend_ordinary(text[start:token_start], start, ids, offsets)
            special.append(len(ids))
            ids.append(self.special_tokens[name])
            offsets.append((token_start, token_end))
            start = token_end
        self._extend_ordinary(text[start:], start, ids, offsets)
        trim = self.hf_json.trim_offsets if self.hf_json is not None else None
        if trim is not None:
            offsets = trimmed_offsets(text, offsets, set(special), trim.add_prefix_space)
        return ids, offsets

    def _special_matches(self, text: str) -> Iterator[tuple[int, int, str]]:
        """(start, end, name) of each special token in `text`, in order: its string, widened over the whitespace
        before it (lstrip) or after it (rstrip) as tokenizer.json sets, never into the previous match."""
        stripping = self.hf_json.stripping_tokens if self.hf_json is not None else {}
        previous_end = 0
        for match in self._special_pattern.finditer(text):
            if match.start() < previous_end:  # inside the whitespace an rstrip token took in
                continue
            start, end = match.span()
            lstrip, rstrip = stripping.get(match.group(), (False, False))
            while lstrip and start > previous_end and text[start - 1] in WHITE_SPACE:
                start -= 1
            while rstrip and end < len(text) and text[end] in WHITE_SPACE:
                end += 1
            previous_end = end
            yield start, end, match.group()

    def cut_before_special_token(self, text: str, end: int) -> int:
        """`end`, or the start of the special token's string in `text` that `end` falls inside of."""
        longest = max(map(len, self.special_tokens))
        for match in self._special_pattern.finditer(text, 0, end + longest):
            if match.start() < end < match.end():
                return match.start()
        return end

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
        normalized, origins = nfc_alignments(text) if nfc else (text, None)
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


def nfc_alignments(text: str) -> tuple[str, tuple[np.ndarray, np.ndarray] | None]:
    """`text` in NFC and, when that changes it, the (start, end) characters of `text` each of its characters comes
    from, as the `tokenizers` library aligns them: NFC decomposes each character and composes the result again; a
    composed character comes from the character its first part came from, alone (`é` from `e` + U+0301 is the `e`;
    the accent then belongs to no token), and the further parts of a decomposition from the character decomposed.
    Composition walks the characters by position, so a character of the reordered marks takes the place of the mark
    that was there (tokenizers' unicode-normalization-alignments does the same)."""
    normalized = unicodedata.normalize("NFC", text)
    if normalized == text:
        return text, None
    decomposed = []  # [character, how many characters of `text` it stands for: 1 for a first part, else 0]
    for character in text:
        parts = unicodedata.normalize("NFD", character)
        decomposed.append([parts[0], 1])
        decomposed.extend([part, 0] for part in parts[1:])
    reorder_marks(decomposed)
    composed = compose(decomposed)
    assert "".join(character for character, _ in composed) == normalized, "NFC by parts must equal NFC"
    starts = np.empty(len(composed), dtype=np.int64)
    position = 0
    for index, (_, count) in enumerate(composed):
        starts[index] = position if count else max(position - 1, 0)
        position += count
    return normalized, (starts, starts + 1)


def reorder_marks(parts: list[list]) -> None:
    """Canonical ordering: each run of combining marks sorted, stably, by combining class, each mark with its
    count."""
    index = 0
    while index < len(parts):
        end = index
        while end < len(parts) and unicodedata.combining(parts[end][0]):
            end += 1
        if end > index:
            parts[index:end] = sorted(parts[index:end], key=lambda part: unicodedata.combining(part[0]))
        index = end + 1


def compose(parts: list[list]) -> list[list]:
    """Canonical composition: a part that composes with the last starter, unblocked, joins it, adding its count."""
    composed: list[list] = []
    starter = None
    last_class = None  # combining class of the last part kept after the starter, None right after it
    for character, count in parts:
        combining_class = unicodedata.combining(character)
        if starter is not None and (last_class is None or 0 < last_class < combining_class):
            joined = unicodedata.normalize("NFC", composed[starter][0] + character)
            if len(joined) == 1:
                composed[starter] = [joined, composed[starter][1] + count]
                continue
        if combining_class == 0:
            starter, last_class = len(composed), None
        else:
            last_class = combining_class
        composed.append([character, count])
    return composed


def trimmed_offsets(text: str, offsets: list[tuple[int, int]], special: set[int], add_prefix_space: bool
                    ) -> list[tuple[int, int]]:
    """`offsets` of the tokens of `text` as a ByteLevel post-processor with trim_offsets leaves them (TrimOffsets).
    It counts the spaces at a token's edges in the token's string: the byte-level string of an ordinary token, in
    which only a space is whitespace, and the matched text of a special token (indices in `special`), whitespace
    that lstrip or rstrip took in among it."""
    trimmed = []
    for index, (start, end) in enumerate(offsets):
        piece = text[start:end]
        spaces = WHITE_SPACE if index in special else " "
        leading = len(piece) - len(piece.lstrip(spaces))
        trailing = len(piece) - len(piece.rstrip(spaces))
        if leading and not ((index == 0 or start == 0) and add_prefix_space and leading == 1):
            start = min(start + leading, end)
        if trailing and end >= trailing:
            end = max(end - trailing, start)
        trimmed.append((start, end))
    return trimmed


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
