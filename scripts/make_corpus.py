"""Regenerate the shipped corpus, titan/data/corpus/stdlib_docs.jsonl.gz, from this Python's own docs.

Documents, in this order:
  1. each topic of `pydoc_data.topics.topics` (the Python reference text `help()` shows), one per topic;
  2. one document per standard-library module: its docstring, then the docstrings of the public classes,
     functions and methods it defines, sorted by name.
Everything is PSF-licensed. The output is byte-identical for the same CPython version and platform
(the committed file was made with CPython 3.11 on Linux); other versions give slightly different text.

    python scripts/make_corpus.py [--output PATH]
"""

import argparse
import gzip
import importlib
import inspect
import json
import pkgutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from pydoc_data.topics import topics
from types import ModuleType

# Run as `python scripts/make_corpus.py`, Python puts scripts/ (not the project root) on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titan.data.dataset import SHIPPED_CORPUS  # noqa: E402
from titan.metrics.log import init_logger, logger  # noqa: E402

# Modules that open windows or browsers, print on import, are Windows-only, or duplicate the topics text.
SKIP_MODULES = {
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "pydoc_data", "lib2to3", "ensurepip",
    "msilib", "msvcrt", "nt", "winreg", "winsound", "distutils", "encodings", "test",
}


def topic_documents() -> Iterator[dict[str, str]]:
    for name in sorted(topics):
        yield {"source": f"pydoc_data.topics:{name}", "text": topics[name].strip()}


def own_doc(obj: object) -> str | None:
    """The docstring `obj` itself defines (not one inherited from a base class), dedented."""
    doc = vars(obj).get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None


class _Elided:
    """Stands for a default value that `signature_text` leaves out."""

    def __repr__(self) -> str:
        return "..."


def stable_default(value: object) -> object:
    """`value` if its repr is plain, portable text; other defaults show as `...`. Reprs of objects carry memory
    addresses, and defaults such as `environ=os.environ` or an interpreter path would copy this machine's
    environment into the corpus."""
    if value is inspect.Parameter.empty or value is None or type(value) in (bool, int, float):
        return value
    if type(value) is str and len(value) <= 40 and "/" not in value and "\\" not in value:
        return value
    return _Elided()


def signature_text(obj: object) -> str:
    """`(a, b=1, c=...)` when Python knows the signature, without annotations (their reprs vary by version)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    parameters = [p.replace(annotation=inspect.Parameter.empty, default=stable_default(p.default))
                  for p in signature.parameters.values()]
    return str(signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty))


def member_sections(qualname: str, obj: object) -> Iterator[str]:
    """A class's or function's docstring, then (for classes) each public method's and property's."""
    doc = own_doc(obj)
    if doc:
        yield f"{qualname}{signature_text(obj) if inspect.isroutine(obj) else ''}\n{doc}"
    if not inspect.isclass(obj):
        return
    for name in sorted(vars(obj)):
        member = vars(obj)[name]
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if name.startswith("_") or not (inspect.isroutine(member) or isinstance(member, property)):
            continue
        doc = own_doc(member)
        if doc:
            signature = signature_text(member) if inspect.isroutine(member) else ""
            yield f"{qualname}.{name}{signature}\n{doc}"


def module_document(module: ModuleType) -> dict[str, str] | None:
    sections = [f"Module {module.__name__}"]
    doc = own_doc(module)
    if doc:
        sections.append(doc)
    for name in sorted(vars(module)):
        obj = vars(module)[name]
        # Only what the module defines: re-exports would repeat other modules' docs.
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isroutine(obj):
            sections.extend(member_sections(f"{module.__name__}.{name}", obj))
    if len(sections) == 1:
        return None
    return {"source": f"module:{module.__name__}", "text": "\n\n".join(sections)}


def stdlib_module_names() -> list[str]:
    """Public top-level stdlib modules and their public submodules, sorted, importable ones only."""
    names = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP_MODULES:
            continue
        module = import_quietly(name)
        if module is None:
            continue
        names.append(name)
        if hasattr(module, "__path__"):
            for info in pkgutil.walk_packages(module.__path__, prefix=f"{name}.", onerror=lambda _: None):
                parts = info.name.split(".")
                # __main__ submodules run a program on import; test packages are not documentation.
                if any(p.startswith("_") or p in ("test", "tests") for p in parts):
                    continue
                names.append(info.name)
    return sorted(set(names))


def import_quietly(name: str) -> ModuleType | None:
    """The module, or None where it can't be imported on this platform or build."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated modules warn on import; their docs are still text
        try:
            return importlib.import_module(name)
        except Exception:  # platform-specific modules raise ImportError, OSError or worse on import
            return None


def module_documents() -> Iterator[dict[str, str]]:
    for name in stdlib_module_names():
        module = import_quietly(name)
        document = module_document(module) if module is not None else None
        if document is not None:
            yield document


def write_corpus(output: Path) -> tuple[int, int]:
    """Write every document as one jsonl line. Returns (documents, bytes of UTF-8 text)."""
    num_documents = num_bytes = 0
    output.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0 and no file name in the gzip header keep the file byte-identical across regenerations.
    with open(output, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        for document in (*topic_documents(), *module_documents()):
            gz.write((json.dumps(document, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8"))
            num_documents += 1
            num_bytes += len(document["text"].encode("utf-8"))
    return num_documents, num_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=SHIPPED_CORPUS, help="gzip-compressed jsonl to write")
    args = parser.parse_args()
    init_logger()
    num_documents, num_bytes = write_corpus(args.output)
    logger.info(f"Wrote {num_documents} documents ({num_bytes} bytes of text, "
                f"{args.output.stat().st_size} bytes compressed) to {args.output}")


if __name__ == "__main__":
    main()
