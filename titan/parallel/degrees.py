"""The degree and batch arithmetic of a job, in one place: the config rules check with it (titan/parallel/rules.py,
titan/train/rules.py), the meshes (titan/parallel/dims.py) and the step (titan/train/build.py) are built from it."""

from titan.config.job import Parallelism, Training


def resolved_shard_degree(par: Parallelism, world_size: int) -> int:
    """--parallelism.data_parallel_shard_degree, with -1 replaced by the ranks the other degrees leave over (at
    least 1; whether the degrees multiply to the world size is validation's to say)."""
    if par.data_parallel_shard_degree != -1:
        return par.data_parallel_shard_degree
    others = (par.pipeline_parallel_degree * par.data_parallel_replicate_degree * par.context_parallel_degree
              * par.tensor_parallel_degree)
    return max(world_size // max(others, 1), 1)


def data_parallel_degree(par: Parallelism, world_size: int) -> int:
    """Ranks that read distinct data: the replicas times the shards."""
    return par.data_parallel_replicate_degree * resolved_shard_degree(par, world_size)


def accumulation_steps(training: Training, dp_degree: int) -> int:
    """Micro-batches per optimizer step: global batch / (local batch x data-parallel degree); 1 with
    --training.global_batch_size -1."""
    if training.global_batch_size == -1:
        return 1
    return training.global_batch_size // (training.local_batch_size * dp_degree)
