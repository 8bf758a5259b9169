"""Regenerate the shipped conversations, titan/data/corpus/stdlib_chats.jsonl.gz, from this Python's docstrings: the
chat data of configs/debug_sft.toml (docs/sft.md).

Each public function of the modules in MODULES with a docstring gives one conversation, of three kinds in turn:
  ask      a user asks what the function does; the assistant answers with the docstring's first paragraph;
  follow   a system prompt, the same question and answer, then how to call it (its signature);
  tool     a user asks which module holds the function; the assistant looks it up with a tool, a tool turn
           answers, and the assistant says where it is and how to import it.
Signatures keep only plain defaults, as scripts/make_corpus.py writes them. Everything is PSF-licensed docstring
text. The output is byte-identical for the same CPython version (the committed file was made with CPython 3.11 on
Linux).

    python scripts/make_conversations.py [--output PATH]
"""

import argparse
import gzip
import importlib
import inspect
import json
import sys
from collections.abc import Iterator
from pathlib import Path

# Run as `python scripts/make_conversations.py`, Python puts scripts/ (not the project root) on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from make_corpus import signature_text  # noqa: E402
from titan.data.dataset import SHIPPED_CORPUS  # noqa: E402

OUTPUT = SHIPPED_CORPUS.parent / "stdlib_chats.jsonl.gz"
MODULES = ("base64", "binascii", "bisect", "calendar", "colorsys", "copy", "csv", "difflib", "filecmp", "fnmatch",
           "functools", "glob", "gzip", "hashlib", "heapq", "html", "inspect", "json", "keyword", "math", "operator",
           "os", "os.path", "pprint", "random", "re", "secrets", "shlex", "shutil", "statistics", "string", "struct",
           "sys", "tempfile", "textwrap", "time", "unicodedata", "urllib.parse", "uuid", "zlib")
MAX_ANSWER_CHARS = 400
SYSTEM = "You are a concise assistant for Python's standard library."


def first_paragraph(doc: str) -> str:
    """The docstring's first paragraph on one line, cut after the sentence that passes MAX_ANSWER_CHARS."""
    paragraph = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    if len(paragraph) > MAX_ANSWER_CHARS:
        cut = paragraph.find(". ", MAX_ANSWER_CHARS // 2)
        paragraph = paragraph[: cut + 1] if cut != -1 else paragraph[:MAX_ANSWER_CHARS]
    return paragraph


def functions() -> Iterator[tuple[str, str, str, str | None]]:
    """(module, name, answer, signature or None) of every documented public function of MODULES, sorted."""
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, value in sorted(vars(module).items()):
            if name.startswith("_") or not callable(value) or inspect.isclass(value) or not value.__doc__:
                continue
            if getattr(value, "__module__", module_name) not in (module_name, module.__name__, None):
                continue  # imported from elsewhere: documented under its own module
            answer = first_paragraph(value.__doc__)
            if len(answer) >= 20:
                # Plain defaults only, as in the shipped corpus: no object addresses or paths of this machine.
                yield module_name, name, answer, signature_text(value) or None


def conversation(number: int, module: str, name: str, answer: str, signature: str | None) -> list[dict[str, str]]:
    question = {"role": "user", "content": f"What does `{module}.{name}` do?"}
    kind = number % 3
    if kind == 1 and signature is not None:
        return [{"role": "system", "content": SYSTEM}, question, {"role": "assistant", "content": answer},
                {"role": "user", "content": "How do I call it?"},
                {"role": "assistant", "content": f"Call it as `{module}.{name}{signature}`."}]
    if kind == 2:
        return [{"role": "user", "content": f"Which module is `{name}` in?"},
                {"role": "assistant", "content": f"Let me look `{name}` up in the standard library."},
                {"role": "tool", "content": json.dumps({"name": name, "module": module})},
                {"role": "assistant", "content": f"`{name}` is in the `{module}` module: `from {module} import "
                                                 f"{name}`. {answer}"}]
    return [question, {"role": "assistant", "content": answer}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    lines = [json.dumps({"messages": conversation(number, *function)}, ensure_ascii=False)
             for number, function in enumerate(functions())]
    # mtime=0 and no file name in the gzip header keep the file byte-identical across regenerations.
    with open(args.output, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as file:
        file.write(("\n".join(lines) + "\n").encode("utf-8"))
    print(f"{args.output}: {len(lines)} conversations")


if __name__ == "__main__":
    main()
