"""Hugging Face export of Titan's tokenizer (titan/data/hf_tokenizer.py): transformers.AutoTokenizer on the
exported folder gives Titan's ids, special ids and decoding for the shipped tokenizer, one freshly trained by
scripts/bpe_train.py and a file in Llama 3's format (128000 ranks, so 256 special tokens); and tiktoken's
rank rule equals Hugging Face's merge list on random vocabularies, every input up to 10 bytes."""

import ast
import itertools
import random
from collections.abc import Iterable
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bpe_train import count_chunks, train_bpe
from test_data import random_unicode
from titan.data.dataset import SHIPPED_CORPUS, read_jsonl_documents
from titan.data.hf_tokenizer import write_hf_tokenizer
from titan.data.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    LLAMA3_NUM_RANKS,
    MAX_RUN_CHARS,
    SHIPPED_TOKENIZER,
    Tokenizer,
    build_tokenizer,
    llama3_special_tokens,
)
from tokenizers import Tokenizer as BackendTokenizer

ROOT = Path(__file__).resolve().parents[1]

TEXTS = {
    "prose": "The quick brown fox jumps over the lazy dog. It's a pangram; we'll see, won't we? \"Yes,\" she said.",
    "code": "def mean(xs: list[float]) -> float:\n\tif not xs:\n\t\traise ValueError('empty')\n"
            "        return sum(xs) / len(xs)  # tabs, then spaces\r\n\n\n}\n  \n",
    "non-ascii": "Grüße aus Köln, Straße! 日本語のテキストと中文。🦙🔥👩‍👩‍👧 e\u0301 n\u0303 مرحبا بالعالم ΑΒΓ Привет",
    "numbers": "3.14159 1234567890 1,000,000 2024-01-31 0x1F -42 1e-9 ١٢٣ ⅷ",
    "whitespace": "a" + " " * 300 + "b\t\t\t\n\n\n   \n  \u00a0\u3000x" + "\n" * 50 + " \r\n" + "\t" * 40,
    "special strings": f"{BOS_TOKEN}Hi{EOS_TOKEN} {EOS_TOKEN}{BOS_TOKEN} <|eot_id|> <|begin_of_text| "
                       f"<|reserved_special_token_5|>",
    "random unicode": random_unicode(3000),
    # Titan cuts longer runs (Hugging Face doesn't, so ids can differ there: see titan/data/hf_tokenizer.py).
    "longest uncut run": "x" + " " * MAX_RUN_CHARS + "y",
}
CORPUS = list(read_jsonl_documents(SHIPPED_CORPUS, origin="test"))


def trained_ranks() -> dict[bytes, int]:
    """~0.3 s of scripts/bpe_train.py; the test texts go in too, so that their non-ASCII gets merges."""
    return train_bpe(CORPUS[-40:] + list(TEXTS.values()) * 5, num_ranks=3000)


def llama3_format_ranks(texts: Iterable[str]) -> dict[bytes, int]:
    """128000 ranks that are a BPE vocabulary (each token joins two lower-ranked ones), in ~0.5 s: the prefixes
    of up to 32 bytes of every pre-tokenized chunk of `texts`, shortest first, so that text meets long tokens;
    then filler tokens that start with byte 1."""
    chunks = count_chunks(texts)
    prefixes = sorted({chunk[:end] for chunk in chunks for end in range(2, min(len(chunk), 32) + 1)})
    prefixes.sort(key=len)  # stable: each length stays in byte order, so the ranks don't depend on set order
    filler = itertools.chain((bytes([1, a]) for a in range(256)),
                             (bytes([1, a, b]) for a, b in itertools.product(range(256), repeat=2)))
    ranks = {bytes([b]): b for b in range(256)}
    for token in itertools.chain(prefixes, filler):
        if len(ranks) == LLAMA3_NUM_RANKS:
            return ranks
        ranks.setdefault(token, len(ranks))
    raise AssertionError(f"only {len(ranks)} ranks")


def build_titan(kind: str) -> Tokenizer:
    if kind == "shipped":
        return build_tokenizer(SHIPPED_TOKENIZER)
    if kind == "trained":
        return Tokenizer(trained_ranks(), name="trained")
    return Tokenizer(llama3_format_ranks(CORPUS + list(TEXTS.values())), name="llama3")


@pytest.fixture(scope="module", params=["shipped", "trained", "llama3"])
def exported(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, PreTrainedTokenizerBase]:
    titan = build_titan(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    written = write_hf_tokenizer(titan, folder)
    assert sorted(path.name for path in written) == ["tokenizer.json", "tokenizer_config.json"]
    return titan, AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("name", TEXTS)
def test_ids_match_titan(exported: tuple[Tokenizer, PreTrainedTokenizerBase], name: str) -> None:
    titan, hf = exported
    ids = titan.encode(TEXTS[name], bos=True, eos=False)
    assert hf(TEXTS[name])["input_ids"] == ids
    assert max(ids[1:]) < len(titan.mergeable_ranks)  # special strings in the text are plain text


def test_ids_match_titan_on_corpus(exported: tuple[Tokenizer, PreTrainedTokenizerBase]) -> None:
    titan, hf = exported
    texts = CORPUS[::25]
    assert hf(texts)["input_ids"] == [titan.encode(text, bos=True, eos=False) for text in texts]


def test_special_tokens(exported: tuple[Tokenizer, PreTrainedTokenizerBase]) -> None:
    titan, hf = exported
    assert (hf.bos_token, hf.eos_token) == (BOS_TOKEN, EOS_TOKEN)
    assert (hf.bos_token_id, hf.eos_token_id) == (titan.bos_id, titan.eos_id)
    assert len(hf) == titan.vocab_size
    assert {name: hf.convert_tokens_to_ids(name) for name in titan.special_tokens} == titan.special_tokens
    if len(titan.mergeable_ranks) == LLAMA3_NUM_RANKS:
        assert list(titan.special_tokens) == llama3_special_tokens()
        assert list(titan.special_tokens.values()) == list(range(128_000, 128_256))


def test_decode(exported: tuple[Tokenizer, PreTrainedTokenizerBase]) -> None:
    titan, hf = exported
    text = "".join(TEXTS.values())
    ids = titan.encode(text, bos=True, eos=True)
    assert hf.decode(ids) == titan.decode(ids) == BOS_TOKEN + text + EOS_TOKEN
    assert hf.decode(ids, skip_special_tokens=True) == text
    specials = list(titan.special_tokens.values())
    assert hf.decode(specials) == titan.decode(specials)
    # Slices that cut a UTF-8 character decode to the same replacement characters.
    ids = titan.encode(TEXTS["non-ascii"], bos=False, eos=False)
    slices = [ids[start:end] for start in range(len(ids)) for end in range(start + 1, min(start + 4, len(ids)) + 1)]
    assert hf.batch_decode(slices) == [titan.decode(ids) for ids in slices]


def test_tokenizer_json_alone(tmp_path: Path) -> None:
    """Without transformers, the `tokenizers` library adds BOS too, and encodes special strings as text once told."""
    titan = build_tokenizer(SHIPPED_TOKENIZER)
    write_hf_tokenizer(titan, tmp_path)
    backend = BackendTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    backend.encode_special_tokens = True
    for text in TEXTS.values():
        assert backend.encode(text).ids == titan.encode(text, bos=True, eos=False)


def random_vocabulary(seed: int) -> dict[bytes, int]:
    """Bytes, then 5..40 tokens over "ab", each the join of two lower-ranked ones in a random order, so that most
    can be reached by several splits and BPE on a token's own bytes often ends in three or more tokens."""
    rng = random.Random(seed)
    ranks = {bytes([b]): b for b in range(256)}
    tokens = [b"a", b"b"]
    num_ranks = 256 + rng.randrange(5, 41)
    for _ in range(1000):
        token = rng.choice(tokens) + rng.choice(tokens)
        if token not in ranks and len(token) <= 8:
            ranks[token] = len(ranks)
            tokens.append(token)
        if len(ranks) == num_ranks:
            break
    return ranks


def test_merge_list_follows_tiktoken_ranks(tmp_path: Path) -> None:
    """Every string over "ab" up to 10 bytes (one pre-tokenized piece, so this is BPE alone) on 20 vocabularies."""
    texts = ["".join(letters) for length in range(1, 11) for letters in itertools.product("ab", repeat=length)]
    for seed in range(20):
        titan = Tokenizer(random_vocabulary(seed), name=f"random{seed}")
        write_hf_tokenizer(titan, tmp_path / str(seed))
        backend = BackendTokenizer.from_file(str(tmp_path / str(seed) / "tokenizer.json"))
        encoded = backend.encode_batch(texts, add_special_tokens=False)
        mismatches = [(text, got.tokens) for text, got in zip(texts, encoded)
                      if got.ids != titan.encode(text, bos=False, eos=False)]
        assert not mismatches, f"seed {seed}: {mismatches[:3]}"


def test_runtime_needs_neither_tokenizers_nor_transformers() -> None:
    """They are test extras (pyproject.toml); the export writes their JSON by hand."""
    source = (ROOT / "titan" / "data" / "hf_tokenizer.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert not imported & {"tokenizers", "transformers"}
