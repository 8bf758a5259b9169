"""--training.dataset hf through the trainer, offline, on a local folder that `datasets` reads: the run trains on the
same documents, bit for bit, as --training.dataset jsonl on the folder's file."""

import json
from pathlib import Path

import datasets
import huggingface_hub
import pytest

from harness.debug_training import train_losses


def test_hf_dataset_folder_trains_like_its_jsonl_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # `datasets` and huggingface_hub read those variables once, on import; their flags hold what they read.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    folder = tmp_path / "data"
    folder.mkdir()
    texts = [f"Document {i} of a local Hugging Face dataset. " + "Titan reads it offline. " * (i + 1)
             for i in range(16)]
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    hf = train_losses(tmp_path / "hf", "--training.steps", "2", "--training.dataset", "hf", "--training.dataset_path",
                      str(folder))
    jsonl = train_losses(tmp_path / "jsonl", "--training.steps", "2", "--training.dataset", "jsonl",
                         "--training.dataset_path", str(folder / "train.jsonl"))
    assert len(hf) == 2 and hf == jsonl
