"""Documents written the way the data sources read them, for the data and token-store tests."""

import json
from pathlib import Path


def write_jsonl(path: Path, texts: list[str]) -> Path:
    """One {"text": ...} line per text at `path`; returns `path`."""
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path
