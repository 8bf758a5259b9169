"""What activation checkpointing does on a run, from its config and its device: which blocks it checkpoints, and
whether they keep their attention outputs, which runs them under a selective-checkpoint context (a dispatch mode
that records every op of the block). The parallel stage applies it (titan/parallel/ac.py); config rules about the
combinations it does not run in read it too."""


def keeps_attention(save_attention: bool, compiled: bool, on_gpu: bool) -> bool:
    """Whether checkpointed blocks keep their attention outputs (--activation_checkpoint.save_attention) on this run.
    Not in eager mode on a GPU: there the selective-checkpoint dispatch mode that keeps them runs Python for every
    op of the block, in forward and in recompute, which cost more than recomputing attention saves (0.69x and 0.81x
    of the step's speed measured on an H100, docs/performance.md). Compiled, the policy is traced into the graph
    and costs nothing at run time; on a CPU the step is compute-bound and keeping attention pays (1.08x)."""
    return save_attention and (compiled or not on_gpu)


def checkpoint_every(option: str) -> int | None:
    """k for `selective_ac_option` "k" (checkpoint every k-th block), None for "op"."""
    return None if option == "op" else int(option)


def saves_by_op(mode: str, selective_option: str) -> bool:
    """Selective "op" AC: every block saves by op, attention always (save_attention does not apply)."""
    return mode == "selective" and checkpoint_every(selective_option) is None


def records_ops(mode: str, selective_option: str, keep_attention: bool) -> bool:
    """Whether checkpointed blocks run under a selective-checkpoint context, which records every op of a block's
    forward and refuses a recompute that runs one the forward did not: selective "op" AC, and full or every-k AC that
    keeps attention (`keep_attention`, keeps_attention's)."""
    return saves_by_op(mode, selective_option) or (mode != "none" and keep_attention)
