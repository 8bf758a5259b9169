"""Conversations in: the chat source (--training.dataset chat), rendered by a chat template
(titan/data/chat_template.py) and tokenized into a token store whose roles.npy says which tokens an assistant wrote.

Rows hold a list of messages under --chat.messages_field ("messages"), each {"role": ..., "content": ...} with role
system, user, assistant or tool; other keys (tool_calls, name, ...) reach the template as they are, and keys whose
value is null are dropped (as transformers drops them). The source is JSONL (.jsonl or .jsonl.gz files: a file, a
folder or a glob) or a Hugging Face dataset folder.

A conversation is stored as the template renders it, token for token what transformers' apply_chat_template gives,
as one document. Its tokens' roles: 0 for what the model reads (system, user and tool turns, the template's headers),
1 for an assistant message's tokens, 2 for the last assistant message's. Each message's characters come from the
template's `{% generation %}` blocks, else from markers (titan/data/turns.py); its tokens are those transformers'
return_assistant_tokens_mask gives for those characters (token_roles). A conversation whose assistant messages
cannot be found, or have no token, is an error: training on it would train on the prompts, silently.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from titan.config.errors import ConfigError
from titan.config.paths import resolve_path
from titan.data.chat_template import ChatTemplate
from titan.data.dataset import find_files, hf_folder_files, read_jsonl_records, stream_hf_dataset, wanted_in_folder
from titan.data.store import CHUNK_CHARS, EncodedChunk, SourceDescription, TokenStore
from titan.data.tokenizer import Tokenizer
from titan.data.turns import METHOD, Span, TurnFinder, TurnNotFound, block_spans, marked_spans
from titan.metrics.log import logger

ROLES = ("system", "user", "assistant", "tool")
CONTEXT, ASSISTANT, LAST_ASSISTANT = 0, 1, 2
"""Values of a chat store's roles.npy: what a token is."""
CHAT_FORMAT = 'one JSON object per line with a list of {"role": ..., "content": ...} messages'


@dataclass(frozen=True)
class Row:
    """One conversation as read, and where it is, for error messages."""

    messages: Any
    where: str


def checked_messages(row: Row, messages_field: str) -> list[dict[str, Any]]:
    """The row's messages without their null-valued keys. Raises a ConfigError naming the row and what is wrong."""
    if not isinstance(row.messages, list) or not row.messages:
        raise ConfigError(f"{row.where}: --chat.messages_field {messages_field!r} is not a non-empty list of "
                          f"messages. Expected {CHAT_FORMAT} under that field.")
    messages = []
    for number, message in enumerate(row.messages):
        if not isinstance(message, dict):
            raise ConfigError(f"{row.where}: message {number} is not an object. Expected {CHAT_FORMAT}.")
        message = {key: value for key, value in message.items() if value is not None}
        if message.get("role") not in ROLES:
            raise ConfigError(f"{row.where}: message {number} has role {message.get('role')!r}; a role is one of "
                              f"{', '.join(ROLES)}. Rename the roles (ShareGPT's from/value rows: from human is "
                              f"user, gpt is assistant) or fix the row.")
        if not isinstance(message.get("content", ""), str):
            raise ConfigError(f"{row.where}: message {number}'s content is not a string. Titan trains on text "
                              f"messages.")
        messages.append(message)
    return messages


def token_roles(offsets: list[tuple[int, int]], messages_spans: list[list[Span]]) -> np.ndarray:
    """Each token's role, from each assistant message's (start, end) character spans: ASSISTANT for the tokens of a
    span, LAST_ASSISTANT for those of the last message's spans, CONTEXT elsewhere. A span's tokens run from the
    token of its first character to the token of its last, as transformers' return_assistant_tokens_mask takes
    them (char_to_token, the first token whose offsets hold the character). Where no token holds an end character
    (offsets trimmed of spaces, an accent NFC composed away) transformers drops the span and every later one, or
    marks the rest of the conversation; here the span's first and last characters that a token holds stand in."""
    roles = np.full(len(offsets), CONTEXT, dtype=np.uint8)
    if not offsets:
        return roles
    starts = np.fromiter((start for start, _ in offsets), dtype=np.int64, count=len(offsets))
    ends = np.fromiter((end for _, end in offsets), dtype=np.int64, count=len(offsets))
    num_chars = int(ends.max())
    # The first token whose end lies past each character; it holds the character when it starts at or before it.
    # Offsets never go back, so no later token can hold a character that this one does not.
    characters = np.arange(num_chars)
    holder = np.searchsorted(np.maximum.accumulate(ends), characters, side="right")
    held = starts[np.minimum(holder, len(offsets) - 1)] <= characters
    for number, spans in enumerate(messages_spans):
        role = LAST_ASSISTANT if number == len(messages_spans) - 1 else ASSISTANT
        for span_start, span_end in spans:
            inside = np.flatnonzero(held[span_start:min(span_end, num_chars)])
            if len(inside):
                roles[holder[span_start + inside[0]] : holder[span_start + inside[-1]] + 1] = role
    return roles


@dataclass(frozen=True)
class ConversationEncoder:
    """Renders and tokenizes conversations with one template."""

    template: ChatTemplate
    tokenizer: Tokenizer
    messages_field: str

    def encode(self, row: Row) -> tuple[list[int], np.ndarray, int] | None:
        """(token ids, roles, rendered characters) of the row's conversation; None for one without an assistant
        message, which would train nothing. Raises a ConfigError for a row the template cannot render or whose
        assistant turns it hides."""
        messages = checked_messages(row, self.messages_field)
        if not any(message["role"] == "assistant" for message in messages):
            return None
        try:
            text, blocks = self.template.render(messages)
        except jinja2.exceptions.TemplateError as err:
            raise ConfigError(f"{row.where}: the chat template, {self.template.origin}, failed on this conversation: "
                              f"{err}. Fix the row or give another template with --chat.template_path.") from None
        finder = TurnFinder(self.template, messages, text, self.tokenizer.cut_before_special_token)
        try:
            spans = block_spans(finder, blocks) if self.template.has_generation_markers else marked_spans(finder)
        except TurnNotFound as err:
            raise ConfigError(f"{row.where}: the chat template, {self.template.origin}, renders this conversation in "
                              f"a way Titan cannot follow: it could not find {err}. The template rewrites or "
                              f"reorders that message's text. Give a template with {{% generation %}} blocks around "
                              f"each assistant turn with --chat.template_path (docs/sft.md).") from None
        ids, offsets = self.tokenizer.encode_rendered(text)
        roles = token_roles(offsets, spans)
        if not roles.any():
            method = ("its {% generation %} blocks mark none of them" if self.template.has_generation_markers else
                      "it has no {% generation %} blocks, and the assistant messages' text is not in its rendering")
            raise ConfigError(f"{row.where}: the chat template, {self.template.origin}, hides the assistant's turns: "
                              f"{method}. Training on this conversation would train on its prompts. Give a template "
                              f"that renders every assistant message with --chat.template_path, ideally with "
                              f"{{% generation %}} blocks around each assistant turn (docs/sft.md).")
        return ids, roles, len(text)


def roles_method(template: ChatTemplate) -> str:
    """How a store's roles were found, as its recipe records it (titan/data/turns.py's METHOD names the version)."""
    return f"{'generation blocks' if template.has_generation_markers else 'markers'}, {METHOD}"


def check_roles_method(store: TokenStore) -> None:
    """A prepared chat store must have found its roles the way Titan finds them now: stores made before
    titan/data/turns.py lost answers and trained the wrong tokens on some templates (docs/sft.md)."""
    recipe = store.meta["source"].get("chat")
    if store.roles is not None and (recipe is None or not str(recipe.get("method", "")).endswith(METHOD)):
        method = None if recipe is None else recipe.get("method")
        raise ConfigError(f"Token store {store.path}: its conversations' roles were found by an older method "
                          f"({method!r}), which loses or misplaces the answers of some templates. Prepare it again "
                          f"with `python -m titan.data.prepare`.")


def read_jsonl_rows(path: Path, messages_field: str, origin: str) -> Iterator[Row]:
    for where, record in read_jsonl_records(path, origin, CHAT_FORMAT):
        if not isinstance(record, dict) or messages_field not in record:
            raise ConfigError(f"{where} has no {messages_field!r} field (--chat.messages_field). Expected "
                              f"{CHAT_FORMAT}.")
        yield Row(record[messages_field], where)


class ConversationSource:
    """The conversations of --training.dataset chat (or --validation.dataset chat) at a path: JSONL files (a file, a
    folder or a glob), or a Hugging Face dataset: a folder without JSONL files, or, for `python -m
    titan.data.prepare`, a hub dataset's name."""

    def __init__(self, dataset_path: str, path_flag: str, encoder: ConversationEncoder) -> None:
        self.origin = f"{path_flag} {dataset_path!r}"
        self.encoder = encoder
        self.dataset_path = dataset_path
        resolved = resolve_path(dataset_path)
        is_glob = any(c in dataset_path for c in "*?[")
        self.hf = not is_glob and (not resolved.exists() or resolved.is_dir() and not any(
            p.is_file() and wanted_in_folder(p.relative_to(resolved), "jsonl") for p in resolved.rglob("*")))
        files = hf_folder_files(dataset_path) if self.hf else tuple(find_files(dataset_path, "jsonl", path_flag))
        template = encoder.template
        recipe = {"template_sha256": template.fingerprint, "template": template.origin,
                  "messages_field": encoder.messages_field, "method": roles_method(template)}
        self.description = SourceDescription("chat", dataset_path, "all", files, recipe)

    def rows(self) -> Iterator[Row]:
        messages_field = self.encoder.messages_field
        if not self.hf:
            for path in self.description.files:
                yield from read_jsonl_rows(path, messages_field, self.origin)
            return
        rows = stream_hf_dataset(self.dataset_path, self.origin, f"{self.origin}, a Hugging Face dataset,",
                                 "give JSONL files")
        for number, record in enumerate(rows):
            where = f"{self.origin}: row {number}"
            if messages_field not in record:
                raise ConfigError(f"{where} has no {messages_field!r} column (--chat.messages_field; columns: "
                                  f"{', '.join(sorted(record))}).")
            yield Row(record[messages_field], where)

    def encoded(self, tokenizer: Tokenizer, dtype: np.dtype, workers: int) -> Iterator[EncodedChunk]:
        """The store's chunks, CHUNK_CHARS rendered characters or more each: conversations rendered and tokenized
        in this process (chat sources are small next to pretraining corpora). `tokenizer` is the encoder's."""
        skipped = 0
        chunk = ChunkBuilder()
        for row in self.rows():
            encoded = self.encoder.encode(row)
            if encoded is None:
                skipped += 1
                continue
            chunk.add(*encoded)
            if chunk.chars >= CHUNK_CHARS:
                yield chunk.build(dtype)
                chunk = ChunkBuilder()
        if chunk.lengths:
            yield chunk.build(dtype)
        if skipped:
            logger.info(f"Data: left out {skipped:,} conversation(s) of {self.origin} without an assistant message: "
                        f"they would train nothing")


@dataclass
class ChunkBuilder:
    ids: list[int] = field(default_factory=list)
    roles: list[np.ndarray] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    chars: int = 0

    def add(self, ids: list[int], roles: np.ndarray, chars: int) -> None:
        self.ids.extend(ids)
        self.roles.append(roles)
        self.lengths.append(len(ids))
        self.chars += chars

    def build(self, dtype: np.dtype) -> EncodedChunk:
        return EncodedChunk(np.asarray(self.ids, dtype=dtype), np.asarray(self.lengths, dtype=np.int64), self.chars,
                            np.concatenate(self.roles))
