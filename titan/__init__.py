"""Titan: a config-driven Llama pretraining framework built on PyTorch's distributed stack."""
