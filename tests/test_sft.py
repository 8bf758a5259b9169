"""Supervised fine-tuning on conversations: chat templates render and tokenize as transformers' apply_chat_template
does, the assistant's tokens are the ones it marks, conversations pack whole, and the data resumes and mixes like
documents (docs/sft.md)."""

import copy
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import jinja2
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from titan.config.errors import ConfigError
from titan.config.job import Chat, Training
from titan.data.chat_template import ChatTemplate, load_chat_template
from titan.data.conversations import ASSISTANT, CONTEXT, LAST_ASSISTANT, ConversationEncoder, Row
from titan.data.dataset import SHIPPED_CORPUS
from titan.data.hf_tokenizer import build_tokenizer_config, build_tokenizer_json
from titan.data.loader import build_dataloader, build_stream
from titan.data.micro_batch import document_layout
from titan.data.packing import ConversationWindows
from titan.data.prepare import main as prepare_main
from titan.data.tokenizer import SHIPPED_TOKENIZER, Tokenizer, build_tokenizer
from titan.models.common.loss import IGNORE_INDEX
from titan.models.llama import ModelArgs, Transformer, init_weights
from titan.train.trainer import Trainer
from titan.validate import load_job_config

from harness.debug_training import DEBUG_TOML

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
SHIPPED_CHATS = SHIPPED_CORPUS.parent / "stdlib_chats.jsonl.gz"
# Each format's template and the special tokens it writes, added to the shipped tokenizer's: (bos, eos, others).
FORMATS = {
    "llama3": (ROOT / "titan/data/templates/llama3.jinja", "<|begin_of_text|>", "<|end_of_text|>",
               ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
    "chatml": (TEMPLATES / "chatml.jinja", None, "<|im_end|>", ["<|im_start|>", "<|im_end|>"]),
    "mistral": (TEMPLATES / "mistral.jinja", "<s>", "</s>",
                ["<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_RESULTS]",
                 "[/TOOL_RESULTS]"]),
    "gemma": (TEMPLATES / "gemma.jinja", "<bos>", "<eos>", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]),
    "deepseek": (TEMPLATES / "deepseek.jinja", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                 ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                  "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]),
}
# Multi-turn, with a system prompt, a tool turn, non-ASCII text and whitespace that some templates trim.
CONVERSATION = [
    {"role": "system", "content": "You answer questions about Python's standard library."},
    {"role": "user", "content": "What does `math.gcd` return for 12 and 18?"},
    {"role": "assistant", "content": "Let me compute it with a tool."},
    {"role": "tool", "content": "{\"gcd\": 6}"},
    {"role": "assistant", "content": "  It returns 6, the greatest common divisor — café ✓.  "},
    {"role": "user", "content": "And for 7 and 5?"},
    {"role": "assistant", "content": "1: they are coprime."},
]
GENERATION_TAGS = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


@pytest.fixture(scope="module")
def shipped() -> Tokenizer:
    return build_tokenizer(SHIPPED_TOKENIZER)


def tokenizer_folder(folder: Path, name: str, shipped: Tokenizer, edit: Callable[[dict], None] | None = None
                     ) -> Path:
    """A Hugging Face tokenizer folder of the shipped tokenizer plus the format's special tokens, with the format's
    template in its tokenizer_config.json; `edit` changes the tokenizer.json's content first."""
    template, bos, eos, specials = {**FORMATS, **MORE_FORMATS}[name][:4]
    tokenizer = build_tokenizer_json(shipped)
    known = {token["content"] for token in tokenizer["added_tokens"]}
    for token in specials:
        if token not in known:
            tokenizer["added_tokens"].append({"id": len(tokenizer["model"]["vocab"]) + len(tokenizer["added_tokens"]),
                                              "content": token, "single_word": False, "lstrip": False,
                                              "rstrip": False, "normalized": False, "special": True})
    if edit is not None:
        edit(tokenizer)
    config = {**build_tokenizer_config(bos, eos), "chat_template": template.read_text(encoding="utf-8")}
    del config["split_special_tokens"]  # transformers' default: special tokens' strings in the text are those tokens
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return folder


def titan_encoding(template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict]) -> tuple[list[int], np.ndarray]:
    encoded = ConversationEncoder(template, tokenizer, "messages").encode(Row(messages, "test conversation"))
    assert encoded is not None
    return encoded[0], encoded[1]


@pytest.mark.parametrize("name", FORMATS)
def test_assistant_tokens_equal_transformers_mask(name: str, tmp_path: Path, shipped: Tokenizer) -> None:
    """Token ids and assistant tokens equal transformers' apply_chat_template(..., return_assistant_tokens_mask=True)
    from the template's {% generation %} blocks; with the blocks removed, rendering message by message finds the
    same tokens. The last assistant turn's tokens are marked as such."""
    folder = tokenizer_folder(tmp_path / name, name, shipped)
    reference = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    tokenizer = build_tokenizer(str(folder / "tokenizer.json"))
    template = load_chat_template("", tokenizer)
    assert template.has_generation_markers and "tokenizer_config.json" in template.origin
    ids, roles = titan_encoding(template, tokenizer, CONVERSATION)
    assert ids == reference["input_ids"]
    assert (roles != CONTEXT).astype(int).tolist() == reference["assistant_masks"]
    assert 0 < (roles == LAST_ASSISTANT).sum() < (roles != CONTEXT).sum()
    last = np.flatnonzero(roles == LAST_ASSISTANT)
    assert (roles[last[0]:] != ASSISTANT).all() and tokenizer.decode(ids[last[0]:last[-1] + 1]).strip().startswith("1:")

    unmarked = ChatTemplate(GENERATION_TAGS.sub("", template.source), "unmarked", template.special_tokens)
    assert not unmarked.has_generation_markers
    unmarked_ids, unmarked_roles = titan_encoding(unmarked, tokenizer, CONVERSATION)
    assert unmarked_ids == ids and unmarked_roles.tolist() == roles.tolist()


def nfc(tokenizer: dict) -> None:
    tokenizer["normalizer"] = {"type": "NFC"}  # Qwen's


def rstrip_specials(tokenizer: dict) -> None:
    for token in tokenizer["added_tokens"][2:]:  # Phi-3's role and end tokens take in the whitespace after them
        token["rstrip"] = True


def trim_offsets(tokenizer: dict) -> None:  # GPT-2-style files' ByteLevel post-processor
    tokenizer["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                   "use_regex": False}


# More formats, each (template, bos, eos, special tokens, the headers before an assistant turn, a tokenizer.json
# setting that changes offsets). The templates in tests/chat_templates are written in each format's style, with
# {% generation %} blocks from an assistant's own text through its end of turn; without the blocks they render
# the format's text.
MORE_FORMATS = {
    "phi3": (TEMPLATES / "phi3.jinja", None, "<|endoftext|>",
             ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], ["<|assistant|>"],
             rstrip_specials),
    "command_r": (TEMPLATES / "command_r.jinja", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>",
                  ["<BOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>",
                   "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>"], ["<|CHATBOT_TOKEN|>"], None),
    "llama2": (TEMPLATES / "llama2.jinja", "<s>", "</s>", ["<s>", "</s>"], ["[/INST]"], None),
    "zephyr": (TEMPLATES / "zephyr.jinja", None, "</s>", ["</s>"], ["<|assistant|>"], trim_offsets),
    "vicuna": (TEMPLATES / "vicuna.jinja", None, "</s>", ["</s>"], ["ASSISTANT:"], None),
    "granite": (TEMPLATES / "granite.jinja", None, "<|end_of_text|>",
                ["<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"], ["assistant<|end_of_role|>"], None),
    "mistral_v3": (TEMPLATES / "mistral_v3.jinja", "<s>", "</s>",
                   ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
                   ["[/INST]", "[/TOOL_RESULTS]"], None),
    "llama31": (TEMPLATES / "llama31.jinja", "<|begin_of_text|>", "<|end_of_text|>",
                ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], ["assistant<|end_header_id|>"], None),
    "qwen3": (TEMPLATES / "qwen3.jinja", None, "<|im_end|>", ["<|im_start|>", "<|im_end|>"], ["<|im_start|>assistant"],
              nfc),
    "multiblock": (TEMPLATES / "multiblock.jinja", None, "<|im_end|>", ["<|im_start|>", "<|im_end|>", "<|im_sep|>"],
                   ["<|im_start|>assistant"], nfc),
}
TOOL_CALL = {"type": "function", "id": "abcdefghi", "function": {"name": "gcd", "arguments": {"a": 12, "b": 18}}}
CONVERSATIONS = {
    # System and tool turns, a tool call with empty content, an answer that starts with a combining accent (NFC
    # composes nothing there; the accent's span edge straddles no cluster), special-token text inside content.
    "tools": [
        {"role": "system", "content": "You answer questions about Python's standard library."},
        {"role": "user", "content": "What does `math.gcd` return for 12 and 18? Say </s> or <|im_end|> if unsure."},
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": "{\"gcd\": 6}", "tool_call_id": "abcdefghi"},
        {"role": "assistant", "content": "\u0301 It returns 6 \u2014 cafe\u0301, e\u0301te\u0301 \u2713.  "},
    ],
    "assistant_first": [
        {"role": "assistant", "content": "Hello! Ask me about `itertools`."},
        {"role": "user", "content": "What does chain do?"},
        {"role": "assistant", "content": "It joins iterables one after another."},
    ],
    # Qwen3-style reasoning: kept after the last user turn only; a long last answer.
    "reasoning": [
        {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "<think>\nIt has no divisor but 1 and 7.\n</think>\n\nYes."},
        {"role": "user", "content": "And 91?"},
        {"role": "assistant", "content": "<think>\n91 = 7 * 13.\n</think>\n\nNo: " + "it is 7 times 13. " * 40},
    ],
}


def assistant_masks(folder: Path, messages: list[dict]) -> tuple[list[int], list[int]] | None:
    """transformers' ids and assistant mask for `messages` rendered by the folder's template; None where the
    template refuses the conversation."""
    try:
        reference = AutoTokenizer.from_pretrained(folder).apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    except jinja2.exceptions.TemplateError:
        return None
    return reference["input_ids"], reference["assistant_masks"]


@pytest.mark.parametrize("name", MORE_FORMATS)
def test_masks_equal_transformers_on_more_formats(name: str, tmp_path: Path, shipped: Tokenizer) -> None:
    """On each format and conversation that transformers renders, Titan's ids and assistant tokens equal
    transformers' mask on the template annotated with generation blocks, both from the blocks and, on the template
    without them, from markers; the last assistant message's tokens are those of the mask from its turn on (all of
    its blocks). A conversation the template refuses is an error naming the row."""
    *_, headers, edit = MORE_FORMATS[name]
    folder = tokenizer_folder(tmp_path / name, name, shipped, edit)
    tokenizer = build_tokenizer(str(folder / "tokenizer.json"))
    marked = load_chat_template("", tokenizer)
    unmarked = ChatTemplate(GENERATION_TAGS.sub("", marked.source), "unmarked", marked.special_tokens)
    rendered = 0
    for conversation, messages in CONVERSATIONS.items():
        reference = assistant_masks(folder, messages)
        if reference is None:
            with pytest.raises(ConfigError, match="failed on this conversation"):
                titan_encoding(unmarked, tokenizer, messages)
            continue
        rendered += 1
        ids, mask = reference
        text, _ = marked.render(messages)
        assert unmarked.render(messages)[0] == text
        _, offsets = tokenizer.encode_rendered(text)
        last_turn = max(text.rfind(header) for header in headers)
        last = [bool(trains) and start >= last_turn for trains, (start, _) in zip(mask, offsets, strict=True)]
        # Without its blocks, nothing says that multiblock's separator between an answer's blocks is not the answer's.
        for template in (marked,) if name == "multiblock" else (marked, unmarked):
            got_ids, roles = titan_encoding(template, tokenizer, messages)
            assert got_ids == ids, (conversation, template.origin)
            assert (roles != CONTEXT).astype(int).tolist() == mask, (conversation, template.origin)
            assert (roles == LAST_ASSISTANT).tolist() == last, (conversation, template.origin)
    assert rendered >= 1  # Llama 2 refuses tool turns and a conversation that starts with the assistant


HIDING = ("{{ bos_token }}{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['role'] + ': ' + m['content'] "
          "+ '\\n' }}{% endif %}{% endfor %}")


@pytest.mark.parametrize("marked", [False, True], ids=["without generation blocks", "with an empty one"])
def test_a_template_that_hides_the_assistant_is_an_error(marked: bool, tmp_path: Path, shipped: Tokenizer) -> None:
    """Neither method finds an assistant token: an error naming the template and the field, not training on the
    prompts."""
    source = HIDING + ("{% generation %}{% endgeneration %}" if marked else "")
    path = tmp_path / "hiding.jinja"
    path.write_text(source)
    template = load_chat_template(str(path), shipped)
    with pytest.raises(ConfigError, match=r"test conversation: the chat template, --chat.template_path '.*hiding"
                                          r"\.jinja', hides the assistant's turns.*--chat\.template_path"):
        titan_encoding(template, shipped, CONVERSATION)


def test_a_template_that_writes_an_answer_twice_is_an_error(tmp_path: Path, shipped: Tokenizer) -> None:
    """Neither a marker (found twice) nor the renderings up to a message (not prefixes of the whole) show which
    copy of the last answer is the turn when the template repeats it: an error naming the template and the message,
    not a guess."""
    path = tmp_path / "recap.jinja"
    path.write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
                    "{{ 'Recap: ' + messages[-1]['content'] }}")
    with pytest.raises(ConfigError, match=r"recap\.jinja', renders this conversation in a way Titan cannot "
                                          r"follow: it could not find assistant message \d"):
        titan_encoding(load_chat_template(str(path), shipped), shipped, CONVERSATION)


def test_a_store_whose_roles_were_found_the_old_way_is_not_reused(tmp_path: Path, shipped: Tokenizer) -> None:
    """A prepared chat store records how its roles were found; one made by the prefix method, which lost answers on
    some templates, is refused with what to do."""
    out = tmp_path / "chats"
    assert prepare_main(["--dataset", "chat", "--dataset_path", str(SHIPPED_CHATS), "--out", str(out)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["source"]["chat"]["method"] == "generation blocks, turns by markers, v2"
    meta["source"]["chat"]["method"] = "generation blocks"
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"roles were found by an older method \('generation blocks'\).*Prepare "
                                          r"it again"):
        build_stream(shipped, Training(dataset="prepared", dataset_path=str(out), seq_len=64))


def test_bad_rows_and_templates_say_what_to_fix(tmp_path: Path, shipped: Tokenizer) -> None:
    template = load_chat_template("", shipped)
    assert template.origin.endswith("(titan/data/templates/titan.jinja)")
    encoder = ConversationEncoder(template, shipped, "messages")
    with pytest.raises(ConfigError, match=r"row 3: message 0 has role 'human'; a role is one of system, user, "
                                          r"assistant, tool"):
        encoder.encode(Row([{"role": "human", "content": "hi"}], "row 3"))
    with pytest.raises(ConfigError, match="row 4: --chat.messages_field 'messages' is not a non-empty list"):
        encoder.encode(Row("hi", "row 4"))
    assert encoder.encode(Row([{"role": "user", "content": "no answer"}], "row 5")) is None
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match=r"--chat.template_path '.*broken.jinja', does not compile"):
        load_chat_template(str(broken), shipped)
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"conversation": CONVERSATION}) + "\n")
    with pytest.raises(ConfigError, match=r"line 1 has no 'messages' field \(--chat.messages_field\)"):
        build_stream(shipped, Training(dataset="chat", dataset_path=str(path)))
    with pytest.raises(ConfigError, match="--training.dataset chat packs conversations into sequences, which needs "
                                          "--model.attn_mask_type block_causal"):
        load_job_config(["--training.dataset", "chat", "--training.dataset_path", str(path),
                         "--model.attn_mask_type", "causal"], world_size=1)


def write_chats(path: Path, conversations: list[list[dict]]) -> Path:
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in conversations))
    return path


def test_conversations_pack_whole_and_long_ones_are_cut_or_dropped(tmp_path: Path, shipped: Tokenizer,
                                                                   titan_records: list[logging.LogRecord]) -> None:
    """Windows hold whole conversations, then padding that never trains; a conversation longer than a window is
    truncated to one of its own, or dropped when nothing of it left trains (here: its last answer is cut off under
    last_assistant), and both are counted in the log."""
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    long = [{"role": "user", "content": "word " * 10}, {"role": "assistant", "content": "first " * 3},
            {"role": "user", "content": "more " * 40}, {"role": "assistant", "content": "last"}]
    path = write_chats(tmp_path / "c.jsonl", [short, short, long, short])
    training = Training(dataset="chat", dataset_path=str(path), seq_len=63, shuffle=False)
    stream = build_stream(shipped, training, Chat(train_on="assistant"))
    windows = stream.sources[0]
    assert isinstance(windows, ConversationWindows) and windows.per_epoch == 3
    template = load_chat_template("", shipped)
    short_ids, short_roles = titan_encoding(template, shipped, short)
    first = windows.window(0)
    assert first.tokens[: 2 * len(short_ids)].tolist() == short_ids * 2  # two whole conversations
    assert first.trains[: 2 * len(short_ids)].tolist() == [role != CONTEXT for role in short_roles.tolist()] * 2
    assert np.flatnonzero(first.ends).tolist() == [len(short_ids) - 1, 2 * len(short_ids) - 1]
    assert not first.trains[2 * len(short_ids):].any()  # padding
    cut = windows.window(1)
    assert cut.ends.tolist() == [False] * 63 + [True] and cut.trains.any()
    message = next(r.getMessage() for r in titan_records if "packs" in r.getMessage())
    assert "packs 4 conversation(s) into 3 window(s)" in message and "1 truncated to one window, 0 dropped" in message
    last_only = build_stream(shipped, training, Chat(train_on="last_assistant")).sources[0]
    assert last_only.per_epoch == 2  # the long conversation's last answer is past its window: dropped
    assert any("1 truncated to one window, 1 dropped for length" in r.getMessage() for r in titan_records)


def test_packed_logits_equal_each_conversation_alone(shipped: Tokenizer) -> None:
    """Block-causal attention over a window of packed conversations (document ends from the store) gives each
    conversation the logits it has on its own: none reads another."""
    stream = build_stream(shipped, Training(dataset="chat", dataset_path=str(SHIPPED_CHATS), seq_len=256,
                                            shuffle=False))
    window = stream.sources[0].window(0)
    ends = np.flatnonzero(window.ends[:-1])
    assert len(ends) >= 2
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=shipped.vocab_size, max_seq_len=256)
    model = Transformer(args)
    init_weights(model, None)
    inputs = torch.from_numpy(window.tokens[None, :-1])
    with torch.no_grad():
        packed = model(inputs, *document_layout(torch.from_numpy(window.ends[None, :-1])))
        start = 0
        for end in ends:
            alone = model(inputs[:, start : end + 1])
            torch.testing.assert_close(packed[:, start : end + 1], alone, rtol=1e-5, atol=1e-5)
            start = end + 1


def test_chat_and_documents_mix_and_resume_exactly(tmp_path: Path, shipped: Tokenizer) -> None:
    """A mixture of the shipped conversations and the shipped documents: chat windows train only assistant tokens,
    document windows every token; a loader resumed from a mid-run state hands out the same batches."""
    training = Training(mixture=[f"chat:{SHIPPED_CHATS}=1", "shipped=1"], seq_len=64, local_batch_size=4)
    loader = build_dataloader(shipped, training, 0, 1)
    iterator = iter(loader)
    batches = [next(iterator) for _ in range(3)]
    state = copy.deepcopy(loader.state_dict())
    later = [next(iterator) for _ in range(4)]
    loader.close()
    masked = torch.cat([labels == IGNORE_INDEX for _, labels, _ in batches + later])
    assert (masked.float().mean(dim=1) > 0.3).any() and (masked.float().mean(dim=1) == 0).any()  # chat and documents
    resumed = build_dataloader(shipped, training, 0, 1)
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    again = [next(iterator) for _ in range(4)]
    resumed.close()
    for got, want in zip(again, later, strict=True):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_fine_tuning_starts_from_a_runs_latest_checkpoint_without_saving(
        fsdp2_straight_run: tuple[Path, str], tmp_path: Path, titan_records: list[logging.LogRecord]) -> None:
    """--checkpoint.initial_load_path naming another run's checkpoint folder loads its latest step (the FSDP 2 run's
    step 10, resharded onto one process), also without --checkpoint.enable, which then saves nothing."""
    run_folder, _ = fsdp2_straight_run
    cfg = load_job_config(["--job.config_file", DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--training.dataset",
                           "chat", "--training.dataset_path", str(SHIPPED_CHATS), "--training.seq_len", "64",
                           "--training.steps", "1", "--checkpoint.initial_load_path",
                           str(run_folder / "checkpoint")], world_size=1)
    Trainer(cfg, world_size=1).run()
    assert any(r.getMessage().startswith(f"Loaded {run_folder / 'checkpoint' / 'step-10'}: step 0, model restored")
               for r in titan_records)
    assert not (tmp_path / "checkpoint").exists()


def test_a_prepared_chat_store_trains_like_the_cached_one(tmp_path: Path, shipped: Tokenizer) -> None:
    """`python -m titan.data.prepare --dataset chat` writes the roles beside the tokens: a job on the prepared store
    reads the batches a job on the conversations reads."""
    out = tmp_path / "chats"
    assert prepare_main(["--dataset", "chat", "--dataset_path", str(SHIPPED_CHATS), "--out", str(out)]) == 0
    assert (out / "roles.npy").is_file() and json.loads((out / "meta.json").read_text())["roles"]
    chat = Training(dataset="chat", dataset_path=str(SHIPPED_CHATS), seq_len=64, local_batch_size=2)
    prepared = Training(dataset="prepared", dataset_path=str(out), seq_len=64, local_batch_size=2)
    for got, want in zip(next(iter(build_dataloader(shipped, prepared, 0, 1))),
                         next(iter(build_dataloader(shipped, chat, 0, 1))), strict=True):
        assert torch.equal(got, want)
