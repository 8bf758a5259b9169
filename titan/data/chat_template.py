"""Chat templates: the Jinja program of a Hugging Face tokenizer that renders a conversation as text, run as
transformers' apply_chat_template runs it, with where each `{% generation %}` block landed in the text.

A template comes from --chat.template_path, else from the tokenizer: the chat_template of the tokenizer_config.json
beside a tokenizer.json (or the chat_template.jinja file beside it, where newer Hugging Face folders keep it), else,
for a tiktoken file, Titan's default for it (titan/data/templates: Llama 3's format for Llama 3's tokenizer.model,
titan.jinja for any other, such as the shipped tokenizer). Templates from the hub are other people's code: they run
in jinja2's immutable sandbox, as in transformers, with the same settings (trim_blocks, lstrip_blocks, loop controls)
and the same helpers (raise_exception, strftime_now, a tojson that keeps non-ASCII text), so that a template renders
here as it does there.
"""

import contextvars
import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from titan.config.errors import ConfigError
from titan.config.paths import resolve_path
from titan.data.tokenizer import BOS_TOKEN, EOS_TOKEN, Tokenizer
from titan.data.tokenizer_json import TOKENIZER_CONFIG_FILE, token_content

TEMPLATES = Path(__file__).resolve().parent / "templates"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""Where Hugging Face folders saved by transformers 4.43 and later keep the template, beside tokenizer_config.json."""
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class Render:
    """One rendering in progress: the characters output so far and the generation blocks' (start, end)."""

    length: int = 0
    spans: list[tuple[int, int]] = field(default_factory=list)


_RENDER: contextvars.ContextVar[Render | None] = contextvars.ContextVar("titan_chat_render", default=None)


class GenerationBlocks(jinja2.ext.Extension):
    """The `{% generation %}...{% endgeneration %}` tag of transformers' templates: renders its body unchanged and
    records where that body starts and ends in the output. The start is the length of what the template yielded
    before the block, so a block inside a macro or a `{% set %}` (whose output is collected before it is yielded)
    is misplaced, here as in transformers."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        line = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_record", []), [], [], body).set_lineno(line)

    def _record(self, caller: Any) -> str:
        text = caller()
        render = _RENDER.get()
        if render is not None:
            render.spans.append((render.length, render.length + len(text)))
        return text


def raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
           sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters; templates expect json.dumps, as transformers gives them.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """`source` compiled in the sandbox. Raises jinja2's TemplateSyntaxError."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment.from_string(source)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    """The Jinja text."""
    origin: str
    """Where it came from, for error messages."""
    special_tokens: dict[str, str]
    """The tokens the template reads by name (bos_token, eos_token, ...), as tokenizer_config.json names them."""

    @property
    def has_generation_markers(self) -> bool:
        return GENERATION_TAG.search(self.source) is not None

    @property
    def fingerprint(self) -> str:
        """A SHA-256 of what decides the rendered text: the source and the special tokens it reads."""
        identity = {"source": self.source, "special_tokens": self.special_tokens}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False
               ) -> tuple[str, list[tuple[int, int]]]:
        """The text of `messages` and the (start, end) characters of each generation block in it. Raises
        jinja2's TemplateError (a template's raise_exception among them)."""
        template = compile_template(self.source)
        render = Render()
        token = _RENDER.set(render)
        try:
            chunks = []
            for chunk in template.generate(messages=messages, tools=None, documents=None,
                                           add_generation_prompt=add_generation_prompt, **self.special_tokens):
                chunks.append(chunk)
                render.length += len(chunk)
        finally:
            _RENDER.reset(token)
        return "".join(chunks), render.spans


def load_chat_template(template_path: str, tokenizer: Tokenizer) -> ChatTemplate:
    """The template of --chat.template_path (a Jinja file, or a tokenizer_config.json to take its chat_template
    from), else the tokenizer's (module docstring). Raises a ConfigError naming the file when there is none or it
    does not compile."""
    special_tokens = template_special_tokens(tokenizer)
    if template_path:
        path = resolve_path(template_path)
        origin = f"--chat.template_path {template_path!r}"
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{origin} can't be read ({err}). Point it at a Jinja chat template, or at a "
                              f"tokenizer_config.json with a chat_template.") from err
        source = config_template(text, origin) if path.suffix == ".json" else text
    elif tokenizer.hf_json is not None:
        source, origin = tokenizer_template(tokenizer)
    else:
        name = "llama3.jinja" if "<|start_header_id|>" in tokenizer.special_tokens else "titan.jinja"
        source = (TEMPLATES / name).read_text(encoding="utf-8")
        origin = (f"Titan's default template for --model.tokenizer_path {tokenizer.path!r} (titan/data/templates/"
                  f"{name})")
    template = ChatTemplate(source, origin, special_tokens)
    try:
        compile_template(source)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ConfigError(f"The chat template, {origin}, does not compile: {err.message} (line {err.lineno}). Fix "
                          f"it or give another with --chat.template_path.") from None
    return template


def tokenizer_template(tokenizer: Tokenizer) -> tuple[str, str]:
    """The chat template a tokenizer.json's folder holds, and where it is, for messages."""
    assert tokenizer.hf_json is not None
    tokenizer_path = str(tokenizer.path)
    config_bytes = tokenizer.hf_json.files.get(TOKENIZER_CONFIG_FILE)
    if config_bytes is not None and "chat_template" in (config := json.loads(config_bytes)):
        origin = f"the chat_template of the {TOKENIZER_CONFIG_FILE} beside --model.tokenizer_path {tokenizer_path!r}"
        return config_template_value(config["chat_template"], origin), origin
    beside = resolve_path(tokenizer_path).parent / CHAT_TEMPLATE_FILE
    if beside.is_file():
        return beside.read_text(encoding="utf-8"), f"{beside}, beside --model.tokenizer_path {tokenizer_path!r}"
    raise ConfigError(f"--model.tokenizer_path {tokenizer_path!r} has no chat template: no chat_template in a "
                      f"{TOKENIZER_CONFIG_FILE} beside it and no {CHAT_TEMPLATE_FILE}. Give one with "
                      f"--chat.template_path (a Jinja file), or use the instruct model's tokenizer folder.")


def config_template(text: str, origin: str) -> str:
    """The chat_template of a tokenizer_config.json's `text`."""
    try:
        config = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"{origin} is not valid JSON ({err}). Give a Jinja file or a tokenizer_config.json."
                          ) from None
    if not isinstance(config, dict) or "chat_template" not in config:
        raise ConfigError(f"{origin} has no chat_template. Give a Jinja file or a tokenizer_config.json with one.")
    return config_template_value(config["chat_template"], origin)


def config_template_value(value: Any, origin: str) -> str:
    """A chat_template field: the template, or a list of named ones of which Titan takes "default" (as
    transformers does when no name is asked for)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ConfigError(f"{origin} is neither a template nor a list of named templates with a \"default\" one. Give "
                      f"the template to use with --chat.template_path.")


def template_special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """The special tokens a template reads by name: every *_token of tokenizer_config.json (as transformers passes
    its special_tokens_map), or BOS and EOS for a tiktoken file."""
    if tokenizer.hf_json is None:
        return {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}
    config_bytes = tokenizer.hf_json.files.get(TOKENIZER_CONFIG_FILE)
    config = json.loads(config_bytes) if config_bytes is not None else {}
    names = {key: token_content(value) for key, value in config.items() if key.endswith("_token")}
    return {key: value for key, value in names.items() if isinstance(value, str)}
