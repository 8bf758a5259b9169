"""--model.tokenizer_path on a Hugging Face tokenizer.json (titan/data/tokenizer_json.py): small Qwen-style and
GPT-2-style files trained here with the `tokenizers` library give the same ids as that library on varied text;
special tokens come only from Titan; BOS and EOS from tokenizer_config.json; other tokenizer kinds are refused with
the flag named; the token store tells two tokenizer.json files apart; a short training run works and its Hugging
Face export carries the files unchanged."""

import functools
import json
import logging
import random
import shutil
import unicodedata
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import regex
from tiktoken_ext import openai_public
from transformers import AutoTokenizer

import tokenizers
from test_data import random_unicode
from test_store import jsonl_source, prepared, write_jsonl
from titan.config.errors import ConfigError
from titan.data import store as store_module
from titan.data.cache import cached_store_path
from titan.data.dataset import SHIPPED_CORPUS, read_jsonl_documents
from titan.data.hf_tokenizer import write_hf_tokenizer
from titan.data.store import open_store, tokenizer_fingerprint
from titan.data.tokenizer import LLAMA3_SPLIT_PATTERN, SHIPPED_TOKENIZER, build_tokenizer, isolated_pieces
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers

from harness.train_script import run_train_here

# Qwen2's (and Qwen3's) pre-tokenizer: Llama 3's regex with single digits (\p{N}, not \p{N}{1,3}).
QWEN2_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                       r"\s*[\r\n]+|\s+(?!\S)|\s+")
# Some of Qwen3's added tokens, in its order: special ones, then ones it marks non-special.
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>"]
QWEN_NON_SPECIAL = ["<tool_call>", "<think>", "</think>"]
QWEN3_BASE_CONFIG = {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                     "tokenizer_class": "Qwen2Tokenizer", "split_special_tokens": False}
TEXTS = {
    "prose": "The quick brown fox jumps over the lazy dog. It's a pangram; we'll see, won't we? \"Yes,\" she said.",
    "code": "def mean(xs: list[float]) -> float:\n\tif not xs:\n\t\traise ValueError('empty')\n"
            "        return sum(xs) / len(xs)  # tabs, then spaces\r\n\n\n}\n  \n",
    "digits": "3.14159 1234567890 1,000,000 2024-01-31 0x1F -42 1e-9 ١٢٣ ⅷ 12345678901234567890",
    "cjk": "日本語のテキストと中文。한국어 텍스트도 있습니다。",
    "emoji": "🦙🔥👩‍👩‍👧 🇯🇵 ✨✨✨ :-)",
    "unicode": "Grüße aus Köln, Straße! e\u0301 n\u0303 A\u030a \ufb01 مرحبا بالعالم ΑΒΓ Привет \u200b\u2028",
    "whitespace": "a" + " " * 300 + "b\t\t\t\n\n\n   \n  \u00a0\u3000x" + "\n" * 50 + " \r\n" + "\t" * 40,
    "special strings": "".join(QWEN_SPECIAL) + " <|im_start|>user\nhi<|im_end|> <|endoftext|",
    "random unicode": random_unicode(3000),
}
CORPUS = list(read_jsonl_documents(SHIPPED_CORPUS, origin="test"))


def train_byte_level_bpe(tokenizer: tokenizers.Tokenizer, vocab_size: int) -> None:
    """~0.3 s: some of the shipped corpus and the test texts, so that their non-ASCII gets merges too."""
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS[-40:] + list(TEXTS.values()) * 5, trainer)


@functools.cache  # trained once: several tests write the file
def qwen_style_json() -> str:
    """Qwen2/Qwen3's layout: NFC, a Split on Qwen2's regex then a ByteLevel that only maps bytes, the added tokens
    after the BPE ids."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    train_byte_level_bpe(tokenizer, 1500)
    tokenizer.add_special_tokens(QWEN_SPECIAL)
    tokenizer.add_tokens([AddedToken(content, special=False, normalized=False) for content in QWEN_NON_SPECIAL])
    return tokenizer.to_str()


def write_qwen_style(folder: Path, config: dict[str, Any] | None = QWEN3_BASE_CONFIG) -> Path:
    """qwen_style_json's file in `folder`, with `config` as tokenizer_config.json (None: no such file)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(qwen_style_json())
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder / "tokenizer.json"


# DeepSeek-V3's pre-tokenizer (its tokenizer.json): digits in threes, then CJK runs, then the rest by a regex of its
# own, each Split isolating its matches, and its special tokens and tokenizer_config.json.
DEEPSEEK_V3_SPLITS = [
    r"\p{N}{1,3}",
    r"[一-龥\u3040-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+",
]
DEEPSEEK_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
DEEPSEEK_V3_CONFIG = {"add_bos_token": True, "add_eos_token": False, "bos_token": DEEPSEEK_SPECIAL[0],
                      "eos_token": DEEPSEEK_SPECIAL[1], "tokenizer_class": "LlamaTokenizerFast"}


def write_split_style(folder: Path, splits: list[str], special: list[str], config: dict[str, Any]) -> Path:
    """A tokenizer.json of isolating Splits on `splits` then a ByteLevel that only maps bytes, no normalizer, a
    ByteLevel post-processor (no template), the `special` tokens after the BPE ids, and `config` as its
    tokenizer_config.json."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in splits),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    train_byte_level_bpe(tokenizer, 1500)
    tokenizer.add_special_tokens(special)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tokenizer.to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def write_deepseek_style(folder: Path) -> Path:
    """DeepSeek-V3's layout: three isolating Splits, BOS and EOS from tokenizer_config.json."""
    return write_split_style(folder, DEEPSEEK_V3_SPLITS, DEEPSEEK_SPECIAL, DEEPSEEK_V3_CONFIG)


def o200k_split_pattern() -> str:
    """o200k's split regex, read from tiktoken's own definition of the encoding (tiktoken_ext/openai_public.py),
    its 200k ranks not downloaded."""
    with mock.patch.object(openai_public, "load_tiktoken_bpe", return_value={}):
        return openai_public.o200k_base()["pat_str"]


# o200k_harmony's special tokens (GPT-OSS's release, ids 199998 and up there), some of its reserved ones among them,
# and its tokenizer_config.json: a BOS it names but never adds, and a chat turn's end as eos_token.
HARMONY_SPECIAL = ["<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>", "<|return|>",
                   "<|constrain|>", "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>",
                   "<|call|>"]
HARMONY_CONFIG = {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
                  "tokenizer_class": "PreTrainedTokenizerFast"}


def write_harmony_style(folder: Path) -> Path:
    """GPT-OSS's o200k_harmony layout: o200k's regex as one isolating Split, no template (so no BOS), its special
    tokens after the BPE ids."""
    return write_split_style(folder, [o200k_split_pattern()], HARMONY_SPECIAL, HARMONY_CONFIG)


def write_gpt2_style(folder: Path) -> Path:
    """GPT-2's layout: a ByteLevel pre-tokenizer with its own regex, no normalizer, and <|endoftext|> both in the
    vocab and among the added tokens; no tokenizer_config.json."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    train_byte_level_bpe(tokenizer, 1200)
    tokenizer.add_special_tokens(["<|endoftext|>"])
    content = json.loads(tokenizer.to_str())
    content["model"]["vocab"]["<|endoftext|>"] = content["added_tokens"][0]["id"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(content))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen_style(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def gpt2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gpt2_style(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def deepseek_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_deepseek_style(tmp_path_factory.mktemp("deepseek"))


@pytest.fixture(scope="module")
def harmony_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_harmony_style(tmp_path_factory.mktemp("harmony"))


def backend(path: Path) -> tokenizers.Tokenizer:
    """The `tokenizers` library on the file, encoding special-token strings in text as text, as Titan does."""
    reference = tokenizers.Tokenizer.from_file(str(path))
    reference.encode_special_tokens = True
    return reference


def edited(path: Path, folder: Path, edit) -> Path:
    """A copy of the tokenizer.json at `path` in `folder`, changed by `edit` (which gets the parsed JSON)."""
    content = json.loads(path.read_text())
    edit(content)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(content))
    return folder / "tokenizer.json"


# Ids


@pytest.mark.parametrize("style", ["qwen", "gpt2", "deepseek", "harmony"])
@pytest.mark.parametrize("name", TEXTS)
def test_ids_match_tokenizers(style: str, name: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(f"{style}_path")
    titan = build_tokenizer(str(path))
    assert titan.encode(TEXTS[name], bos=False, eos=False) == backend(path).encode(TEXTS[name]).ids


@pytest.mark.parametrize("style", ["qwen", "gpt2", "deepseek", "harmony"])
def test_ids_match_tokenizers_on_corpus(style: str, request: pytest.FixtureRequest) -> None:
    """Documents the BPE was not trained on (the trained-on ones end the corpus)."""
    path = request.getfixturevalue(f"{style}_path")
    titan = build_tokenizer(str(path))
    texts = CORPUS[:-40:10]
    assert [encoding.ids for encoding in backend(path).encode_batch(texts)] == \
        [titan.encode(text, bos=False, eos=False) for text in texts]


def test_qwen_split_takes_digits_one_at_a_time(qwen_path: Path) -> None:
    """Qwen2's regex, not Llama 3's \\p{N}{1,3}: a number is one token per digit, whatever the merges."""
    titan = build_tokenizer(str(qwen_path))
    assert [titan.decode([token]) for token in titan.encode("x 2024", bos=False, eos=False)] == \
        ["x", " ", "2", "0", "2", "4"]


def test_deepseek_splits_digits_in_threes_and_cjk_apart(deepseek_path: Path) -> None:
    """Each of DeepSeek-V3's Splits cuts the pieces the one before left: digits in threes from the text, CJK runs
    from what is between them, then the rest, and the ids are those of each piece on its own; BOS and EOS are its
    sentence tokens."""
    text = "ab1234中文cd"
    pieces = isolated_pieces(text, [regex.compile(pattern) for pattern in DEEPSEEK_V3_SPLITS])
    assert pieces == ["ab", "123", "4", "中文", "cd"]
    titan = build_tokenizer(str(deepseek_path))
    assert titan.encode(text, bos=False, eos=False) == [token for piece in pieces
                                                         for token in titan.encode(piece, bos=False, eos=False)]
    assert (titan.bos_id, titan.eos_id) == (titan.special_tokens[DEEPSEEK_SPECIAL[0]],
                                            titan.special_tokens[DEEPSEEK_SPECIAL[1]])


def test_harmony_splits_as_o200k_and_adds_no_bos(harmony_path: Path, titan_records: list[logging.LogRecord]) -> None:
    """GPT-OSS's tokenizer.json read through Titan's reader: o200k's split (digits in threes, a letter run with its
    leading punctuation, a capitalised run apart from the next), no BOS although tokenizer_config.json names one, as
    transformers' own tokenizer of the file adds none, and <|endoftext|> as the documents' EOS, not the config's
    <|return|> (a chat turn's end)."""
    titan = build_tokenizer(str(harmony_path))
    assert titan.hf_json.split_pattern == o200k_split_pattern() and not titan.hf_json.isolating_splits
    assert regex.findall(titan.hf_json.split_pattern, "1234567.HelloWORLD's") == ["123", "456", "7", ".Hello",
                                                                                  "WORLD's"]
    hf = AutoTokenizer.from_pretrained(harmony_path.parent)
    assert hf("hi")["input_ids"] == titan.encode("hi", bos=True, eos=False)
    assert titan.bos_id is None and titan.eos_id == titan.special_tokens["<|endoftext|>"]
    assert any("a chat turn's end" in record.getMessage() for record in titan_records)


def test_nfc_before_encoding(qwen_path: Path, gpt2_path: Path) -> None:
    decomposed, composed = "Cafe\u0301 A\u030a", "Café Å"
    qwen = build_tokenizer(str(qwen_path))
    assert qwen.encode(decomposed, bos=False, eos=False) == qwen.encode(composed, bos=False, eos=False)
    gpt2 = build_tokenizer(str(gpt2_path))  # no normalizer: the combining marks stay
    assert gpt2.encode(decomposed, bos=False, eos=False) != gpt2.encode(composed, bos=False, eos=False)


# Characters a rendered chat template's offsets must follow: combining marks NFC composes, reorders or splits off,
# Hangul jamo, spaces that trim_offsets and lstrip/rstrip act on, special tokens' strings.
OFFSET_PIECES = ["a", "e", "x", " ", "  ", "\n", "\t", "\u00a0", "\u3000", "\u0301", "\u0323", "\u0344", "\u0958",
                 "\u1100", "\u1161", "\u11a8", "caf\u00e9", "cafe\u0301", " It", "\u2713", "12", "!!", "\U0001f999",
                 *QWEN_SPECIAL[1:3]]


@pytest.mark.parametrize("style", ["qwen", "gpt2", "deepseek", "harmony"])
def test_rendered_offsets_match_tokenizers(style: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """encode_rendered's ids and (start, end) characters are the `tokenizers` library's (which transformers'
    assistant mask reads): NFC's alignments (Qwen's normalizer; `e` + U+0301 is the `e` alone), trim_offsets (the
    GPT-2 and DeepSeek styles' ByteLevel post-processor: a space-only token gets an empty span), and added tokens
    that take in the whitespace beside them (lstrip, rstrip, both), on random mixes of such characters."""
    def strip_settings(content: dict) -> None:
        for number, token in enumerate(content["added_tokens"]):
            token["lstrip"], token["rstrip"] = number % 3 != 1, number % 3 != 0
        if style == "deepseek":
            content["added_tokens"] += [dict(content["added_tokens"][-1], id=content["added_tokens"][-1]["id"] + 1 + i,
                                             content=name) for i, name in enumerate(QWEN_SPECIAL[1:3])]
    original = request.getfixturevalue(f"{style}_path")
    path = edited(original, tmp_path, strip_settings)
    if (original.parent / "tokenizer_config.json").is_file():
        shutil.copy(original.parent / "tokenizer_config.json", tmp_path)
    reference = tokenizers.Tokenizer.from_file(str(path))
    titan = build_tokenizer(str(path))
    rng = random.Random(style)
    texts = ["Caf\u00e9 cafe\u0301 <|im_end|>  \n x", *("".join(rng.choice(OFFSET_PIECES) for _ in range(12))
                                                           for _ in range(300))]
    for text in texts:
        expected = reference.encode(text, add_special_tokens=False)
        assert titan.encode_rendered(text) == (expected.ids, expected.offsets), text


# Special tokens, BOS and EOS


def test_special_tokens_keep_their_ids_and_come_only_from_titan(qwen_path: Path) -> None:
    titan = build_tokenizer(str(qwen_path))
    added = {token["content"]: token["id"] for token in json.loads(qwen_path.read_text())["added_tokens"]}
    assert titan.special_tokens == added and list(added) == QWEN_SPECIAL + QWEN_NON_SPECIAL
    assert titan.vocab_size == max(added.values()) + 1 == len(json.loads(qwen_path.read_text())["model"]["vocab"]) + 7
    assert (titan.bos_id, titan.eos_id) == (None, added["<|endoftext|>"])
    text = "".join(added) + " hi"
    ids = titan.encode(text, bos=True, eos=True)
    assert ids[-1] == titan.eos_id and max(ids[:-1]) < min(added.values())  # no BOS; the strings are plain text
    # Hugging Face matches its non-special added tokens in text even with encode_special_tokens; Titan doesn't.
    assert backend(qwen_path).encode("<think>").ids == [added["<think>"]]
    assert titan.encode("<think>", bos=False, eos=False) != [added["<think>"]]


def test_gpt2_endoftext_is_special_not_mergeable(gpt2_path: Path) -> None:
    titan = build_tokenizer(str(gpt2_path))
    vocab = json.loads(gpt2_path.read_text())["model"]["vocab"]
    assert titan.vocab_size == len(vocab) and titan.special_tokens == {"<|endoftext|>": len(vocab) - 1}
    assert len(titan.mergeable_ranks) == len(vocab) - 1 and titan.eos_id == len(vocab) - 1
    assert titan.bos_id is None


@pytest.mark.parametrize("config, bos, eos", [
    (None, None, "<|endoftext|>"),
    (QWEN3_BASE_CONFIG, None, "<|endoftext|>"),
    ({"bos_token": None, "eos_token": "<|im_end|>", "chat_template": "<|im_start|>...<|im_end|>"}, None,
     "<|endoftext|>"),
    ({"bos_token": {"__type": "AddedToken", "content": "<|im_start|>"}, "eos_token": {"content": "<|endoftext|>"},
      "add_bos_token": True}, "<|im_start|>", "<|endoftext|>"),
    # Named, but neither added by the file's template (it has none) nor by add_bos_token: transformers adds none.
    ({"bos_token": "<|im_start|>", "eos_token": "<|endoftext|>"}, None, "<|endoftext|>"),
    ({"bos_token": "<|im_start|>", "add_bos_token": False, "eos_token": "<|endoftext|>"}, None, "<|endoftext|>"),
    ({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}, None, "<|endoftext|>"),
], ids=["no-config", "qwen3-base", "qwen3-instruct", "dict-tokens", "named-not-added", "add-bos-false",
        "bos-is-eos"])
def test_bos_and_eos_from_tokenizer_config(qwen_path: Path, tmp_path: Path, config: dict[str, Any] | None,
                                           bos: str | None, eos: str, titan_records: list[logging.LogRecord]) -> None:
    shutil.copy(qwen_path, tmp_path / "tokenizer.json")
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    titan = build_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (titan.bos_id, titan.eos_id) == (titan.special_tokens.get(bos), titan.special_tokens[eos])
    ids = titan.encode("hi", bos=True, eos=True)
    assert ids == ([titan.bos_id] if bos else []) + titan.encode("hi", bos=False, eos=False) + [titan.eos_id]
    overridden = [r.getMessage() for r in titan_records if "a chat turn's end" in r.getMessage()]
    assert len(overridden) == (config is not None and config.get("eos_token") == "<|im_end|>")


def without_endoftext(content: dict[str, Any]) -> None:
    content["added_tokens"] = [token for token in content["added_tokens"] if token["content"] != "<|endoftext|>"]


def test_eos_from_config_when_there_is_no_endoftext(qwen_path: Path, tmp_path: Path) -> None:
    path = edited(qwen_path, tmp_path, without_endoftext)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    titan = build_tokenizer(str(path))
    assert titan.eos_id == titan.special_tokens["<|im_end|>"] and "<|endoftext|>" not in titan.special_tokens
    assert titan.vocab_size == max(titan.special_tokens.values()) + 1  # the removed id is a gap below it


@pytest.mark.parametrize("config, message", [
    (None, r"--model\.tokenizer_path .* has no EOS: no <\|endoftext\|> or <\|end_of_text\|> among its added_tokens"),
    ({"eos_token": "<|eos|>"}, r"names eos_token '<\|eos\|>', which is not one of the tokenizer\.json's added_tokens"),
    ({"eos_token": "<|im_end|>", "bos_token": "<s>"}, r"names bos_token '<s>'"),
], ids=["no-eos", "unknown-eos", "unknown-bos"])
def test_missing_or_unknown_bos_eos_is_a_config_error(qwen_path: Path, tmp_path: Path,
                                                      config: dict[str, Any] | None, message: str) -> None:
    path = edited(qwen_path, tmp_path, without_endoftext)
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message) as err:
        build_tokenizer(str(path))
    assert "--model.tokenizer_path" in str(err.value)


# Decoding


@pytest.mark.parametrize("style", ["qwen", "gpt2"])
def test_decode_round_trip(style: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(f"{style}_path")
    titan, reference = build_tokenizer(str(path)), backend(path)
    text = "".join(TEXTS.values())
    ids = titan.encode(text, bos=True, eos=True)
    expected = unicodedata.normalize("NFC", text) if style == "qwen" else text
    assert titan.decode(ids) == expected + "<|endoftext|>"
    assert reference.decode(ids, skip_special_tokens=False) == titan.decode(ids)
    specials = list(titan.special_tokens.values())
    assert titan.decode(specials) == "".join(titan.special_tokens)
    # Slices that cut a UTF-8 character decode to the same replacement characters.
    ids = titan.encode(TEXTS["emoji"] + TEXTS["cjk"], bos=False, eos=False)
    slices = [ids[start:start + 2] for start in range(len(ids) - 1)]
    assert reference.decode_batch(slices) == [titan.decode(part) for part in slices]


def test_titan_export_reads_back_as_the_same_tokenizer(tmp_path: Path) -> None:
    """Titan's own Hugging Face export (Llama 3's layout: ignore_merges, every split of a token as a merge, BOS from
    the config) read as a tokenizer.json gives the tiktoken file's ids."""
    shipped = build_tokenizer(SHIPPED_TOKENIZER)
    write_hf_tokenizer(shipped, tmp_path)
    again = build_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (again.bos_id, again.eos_id, again.vocab_size) == (shipped.bos_id, shipped.eos_id, shipped.vocab_size)
    for text in TEXTS.values():
        assert again.encode(text, bos=True, eos=True) == shipped.encode(text, bos=True, eos=True)


# Refusals


def sentencepiece_bpe(folder: Path) -> None:
    """Llama 2's and Mistral's kind: BPE over "▁"-marked words with byte fallback."""
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.train_from_iterator(CORPUS[:20], trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"],
                                                                  show_progress=False))
    tokenizer.save(str(folder / "tokenizer.json"))


def word_level_model(model: Any, trainer: Any) -> Any:
    def write(folder: Path) -> None:
        tokenizer = tokenizers.Tokenizer(model)
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer.train_from_iterator(CORPUS[:20], trainer)
        tokenizer.save(str(folder / "tokenizer.json"))
    return write


def edit_of_qwen(edit) -> Any:
    def write(folder: Path) -> None:
        edited(write_qwen_style(folder / "source"), folder, edit)
    return write


def swap_two_merged_ids(content: dict[str, Any]) -> None:
    vocab = content["model"]["vocab"]
    first, second = ("".join(pair) for pair in content["model"]["merges"][:2])
    vocab[first], vocab[second] = vocab[second], vocab[first]


@pytest.mark.parametrize("write, message", [
    (word_level_model(models.WordPiece(unk_token="[UNK]"), trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[UNK]"], show_progress=False)), "is a 'WordPiece' tokenizer.json"),
    (word_level_model(models.Unigram(), trainers.UnigramTrainer(vocab_size=100, show_progress=False)),
     "is a 'Unigram' tokenizer.json"),
    (sentencepiece_bpe, "with byte_fallback set"),
    (word_level_model(models.BPE(unk_token="[UNK]"), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]"], show_progress=False)), r"has pre-tokenizers \['Whitespace'\]"),
    (edit_of_qwen(lambda c: c["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True)),
     "needs a ByteLevel without add_prefix_space last"),
    (edit_of_qwen(lambda c: c["pre_tokenizer"]["pretokenizers"][1].update(use_regex=True)),
     "with the ByteLevel's use_regex True"),
    (edit_of_qwen(lambda c: c["pre_tokenizer"]["pretokenizers"][0].update(behavior="Removed")),
     "behavior 'Removed'"),
    (edit_of_qwen(lambda c: c.update(normalizer={"type": "Lowercase"})), "has a 'Lowercase' normalizer"),
    (edit_of_qwen(lambda c: c.update(decoder={"type": "WordPiece"})), "has a 'WordPiece' decoder"),
    (edit_of_qwen(swap_two_merged_ids), r"has merge 1 .* out of id order"),
    (edit_of_qwen(lambda c: c["model"]["vocab"].update(zzqq=10**6)), "multi-byte vocab tokens that no merge forms"),
    (edit_of_qwen(lambda c: c["model"]["vocab"].update(zzqq=0)), "gives one id to two tokens"),
    (edit_of_qwen(lambda c: c["model"]["vocab"].pop("Ā")), "no token for 1 of the 256 single bytes"),
    (lambda folder: (folder / "tokenizer.json").write_text('{"model": '), "is not valid JSON"),
    (lambda folder: (folder / "tokenizer.json").write_text('{"version": "1.0"}'), "without a tokenizer `model`"),
], ids=["wordpiece", "unigram", "sentencepiece-bpe", "whitespace-bpe", "prefix-space", "two-regexes",
        "split-removed", "lowercase", "wordpiece-decoder", "merge-order", "unmerged-token", "shared-id",
        "missing-byte", "bad-json", "no-model"])
def test_unsupported_tokenizer_json_is_refused(tmp_path: Path, write, message: str) -> None:
    write(tmp_path)
    with pytest.raises(ConfigError, match=message) as err:
        build_tokenizer(str(tmp_path / "tokenizer.json"))
    assert f"--model.tokenizer_path '{tmp_path / 'tokenizer.json'}'" in str(err.value)
    assert "Titan reads byte-level BPE tokenizer.json files" in str(err.value)


# Token stores


def llama3_regex(content: dict[str, Any]) -> None:
    content["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = LLAMA3_SPLIT_PATTERN


def test_store_identity_tells_tokenizer_json_files_apart(qwen_path: Path, gpt2_path: Path, tmp_path: Path) -> None:
    """Another vocabulary, another split regex or another EOS (here: no <|endoftext|>, so the config's) tokenizes
    differently, so each gets its own fingerprint, cached store and store check; the same file elsewhere doesn't."""
    qwen = build_tokenizer(str(qwen_path))
    shutil.copytree(qwen_path.parent, tmp_path / "copy")
    others = {
        "gpt2": build_tokenizer(str(gpt2_path)),
        "llama3-regex": build_tokenizer(str(edited(qwen_path, tmp_path / "regex", llama3_regex))),
    }
    edited(qwen_path, tmp_path / "eos", without_endoftext)
    (tmp_path / "eos" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    others["im-end"] = build_tokenizer(str(tmp_path / "eos" / "tokenizer.json"))
    assert qwen.mergeable_ranks == others["llama3-regex"].mergeable_ranks  # the regex alone differs
    source = jsonl_source(write_jsonl(tmp_path / "d.jsonl", ["one document", "another"]))
    fingerprints = {name: tokenizer_fingerprint(tokenizer) for name, tokenizer in others.items()}
    fingerprints["qwen"] = tokenizer_fingerprint(qwen)
    assert len(set(fingerprints.values())) == 4, fingerprints
    assert tokenizer_fingerprint(build_tokenizer(str(tmp_path / "copy" / "tokenizer.json"))) == fingerprints["qwen"]
    paths = {cached_store_path(source, tokenizer, tmp_path) for tokenizer in [qwen, *others.values()]}
    assert len(paths) == 4
    (tmp_path / "store").mkdir()
    store = prepared(tmp_path / "store", qwen)
    assert open_store(store, qwen).num_tokens > 0
    for name, other in others.items():
        with pytest.raises(ConfigError, match="tokenized by another tokenizer"):
            open_store(store, other)


def test_store_holds_documents_without_bos(qwen_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each document is its tokens + <|endoftext|>; spawned tokenizing processes get the tokenizer.json's rules."""
    qwen = build_tokenizer(str(qwen_path))
    texts = [f"Dokument {i}: Grüße e\u0301 " + "lorem ipsum 123 " * (i % 7) for i in range(300)]
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    one = prepared(tmp_path / "one", qwen, texts)
    store = open_store(one, qwen)
    first = store.tokens[store.documents[0]:store.documents[1]].tolist()
    assert first == qwen.encode(texts[0], bos=False, eos=False) + [qwen.eos_id]
    monkeypatch.setattr(store_module, "CHUNK_CHARS", 500)
    monkeypatch.setattr(store_module, "PARALLEL_FROM_CHARS", 1_000)
    many = prepared(tmp_path / "many", qwen, texts, workers=2)
    for name in ("tokens.npy", "documents.npy"):
        assert (one / name).read_bytes() == (many / name).read_bytes()


# Hugging Face export


def test_export_carries_the_files_or_writes_a_config(qwen_path: Path, gpt2_path: Path, tmp_path: Path) -> None:
    qwen = build_tokenizer(str(qwen_path))
    write_hf_tokenizer(qwen, tmp_path / "qwen")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "qwen" / name).read_bytes() == (qwen_path.parent / name).read_bytes()
    gpt2 = build_tokenizer(str(gpt2_path))
    write_hf_tokenizer(gpt2, tmp_path / "gpt2")
    assert (tmp_path / "gpt2" / "tokenizer.json").read_bytes() == gpt2_path.read_bytes()
    config = json.loads((tmp_path / "gpt2" / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == (None, "<|endoftext|>", False)
    for tokenizer, folder in ((qwen, "qwen"), (gpt2, "gpt2")):
        hf = AutoTokenizer.from_pretrained(tmp_path / folder)
        assert hf.eos_token_id == tokenizer.eos_id
        for name in ("prose", "code", "digits", "cjk", "unicode"):
            assert hf(TEXTS[name])["input_ids"] == tokenizer.encode(TEXTS[name], bos=True, eos=False), (folder, name)


def test_short_training_run_and_its_export(qwen_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two steps on the shipped corpus with the Qwen-style tokenizer (causal attention: it has no BOS), exported
    to Hugging Face format at the end: the export's tokenizer files are the run's, and config.json has its ids."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dump = tmp_path / "run"
    result = run_train_here("--model.tokenizer_path", str(qwen_path), "--training.steps", "2",
                            "--training.seq_len", "64", "--training.local_batch_size", "2",
                            "--model.attn_mask_type", "causal", "--metrics.log_freq", "1",
                            "--checkpoint.enable", "--checkpoint.last_save_in_hf", "--job.dump_folder", str(dump))
    assert result.returncode == 0, result.stdout
    export = dump / "checkpoint" / "step-2"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (export / name).read_bytes() == (qwen_path.parent / name).read_bytes()
    config = json.loads((export / "config.json").read_text())
    titan = build_tokenizer(str(qwen_path))
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == \
        (None, titan.eos_id, titan.vocab_size)
