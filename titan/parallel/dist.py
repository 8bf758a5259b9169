"""The device this process trains on."""

import os

import torch


def build_device() -> torch.device:
    """CUDA device LOCAL_RANK when a GPU is visible (torchrun sets LOCAL_RANK), otherwise the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")
