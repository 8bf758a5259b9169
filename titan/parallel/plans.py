"""Each model family's parallelize plan, by --model.name: the one place the parallel stages learn the family."""

from collections.abc import Callable

from titan.parallel.llama import parallelize_llama
from titan.parallel.qwen3 import parallelize_qwen3

PARALLELIZE_PLANS: dict[str, Callable[..., None]] = {"llama3": parallelize_llama, "qwen3": parallelize_qwen3}
