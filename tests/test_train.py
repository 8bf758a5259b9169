"""The training loop on the real debug model, shipped corpus and tokenizer, on CPU."""

import gc
import json
import logging
import math
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode

from titan.checkpoint.dcp import Checkpointer
from titan.train.nan_guard import NonFiniteLossError, nonfinite_reason, stop_error, stop_hints
from titan.train.step import TrainingStep
from titan.train.trainer import Trainer
from titan.validate import load_job_config

from harness.debug_training import NUM_LAYERS, build_trainer
from harness.nan_injection import nan_at
from harness.trainer_probe import counting_host_reads


def read_metrics(folder: Path) -> list[dict]:
    """The records of metrics.jsonl but the job's goodput (test_restarts.py)."""
    return [record for record in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
            if "goodput_pct" not in record]


def test_the_job_description_is_logged_at_startup(tmp_path: Path,
                                                  titan_records: list[logging.LogRecord]) -> None:
    build_trainer(tmp_path, "--job.description", "ablation 3: no weight decay")
    assert "Job: ablation 3: no weight decay (--job.description)" in [r.getMessage() for r in titan_records]


def test_loss_falls_on_shipped_corpus(tmp_path: Path) -> None:
    build_trainer(tmp_path, "--training.steps", "40", "--optimizer.lr", "2e-3", "--lr_scheduler.warmup_steps",
                  "5").run()
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses


def test_metrics_records_and_written_config(tmp_path: Path) -> None:
    build_trainer(tmp_path, "--training.steps", "4", "--metrics.log_freq", "2").run()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 4]
    for record in records:
        assert {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mem_gib", "data_wait_pct", "eta_s"} <= set(record)
        assert "mfu_pct" not in record  # no known peak FLOP/s on a CPU
        assert record["tps"] > 0 and math.isfinite(record["loss"])
    again = load_job_config(["--job.config_file", str(tmp_path / "config.toml")], world_size=1)
    assert again.training.steps == 4 and again.training.seq_len == 64 and again.job.dump_folder == str(tmp_path)


class StepWallClock:
    """Wall-clock times of a run's steps, taken around the trainer's own calls: when each run's loop started, when
    each step's work ended (its update queued, which on CPU means done), how long each save and evaluation took, and
    how long each step took to get its batches (from drawing them to the first forward). Slows the step loop where
    asked: `slow_steps` maps a step to extra seconds of compute, `slow_data` to extra seconds of waiting for data."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, slow_steps: dict[int, float], slow_data: dict[int, float]):
        self.loop_started: dict[int, float] = {}
        """When each run's loop began, by the run's first step."""
        self.ended: dict[int, float] = {}
        self.set_aside: dict[int, float] = {}
        """Seconds of saves and evaluations after each step."""
        self.data_wait: dict[int, float] = {}
        self.drawing: tuple[int, float] = (0, 0.0)
        """(the step whose batches are being drawn, since when)."""
        clock = self
        original_run, original_queue_gradients = Trainer.run, Trainer.queue_gradients
        original_next_batch, original_compute_gradients = Trainer.next_batch, TrainingStep.compute_gradients
        original_queue_update = Trainer.queue_update

        def run(trainer: Trainer) -> None:
            clock.loop_started[trainer.first_step] = time.perf_counter()
            original_run(trainer)

        def queue_gradients(trainer: Trainer, data: Iterator) -> object:
            clock.drawing = (trainer.step, time.perf_counter())
            return original_queue_gradients(trainer, data)

        def next_batch(trainer: Trainer, data: Iterator) -> object:
            time.sleep(slow_data.get(trainer.step, 0.0))
            return original_next_batch(trainer, data)

        def compute_gradients(training: TrainingStep, micro_batches: list) -> object:
            step, since = clock.drawing
            clock.data_wait[step] = time.perf_counter() - since
            time.sleep(0.1 + slow_steps.get(step, 0.0))
            return original_compute_gradients(training, micro_batches)

        def queue_update(trainer: Trainer, queued: object) -> None:
            original_queue_update(trainer, queued)
            clock.ended[queued.step] = time.perf_counter()

        def set_aside(original: object, step_of: object) -> object:
            def timed(owner: object, *args: object, **kwargs: object) -> object:
                start = time.perf_counter()
                result = original(owner, *args, **kwargs)
                step = step_of(owner, *args)
                clock.set_aside[step] = clock.set_aside.get(step, 0.0) + time.perf_counter() - start
                return result
            return timed

        monkeypatch.setattr(Trainer, "run", run)
        monkeypatch.setattr(Trainer, "queue_gradients", queue_gradients)
        monkeypatch.setattr(Trainer, "next_batch", next_batch)
        monkeypatch.setattr(TrainingStep, "compute_gradients", compute_gradients)
        monkeypatch.setattr(Trainer, "queue_update", queue_update)
        monkeypatch.setattr(Trainer, "validate", set_aside(Trainer.validate, lambda trainer: trainer.step))
        monkeypatch.setattr(Checkpointer, "save", set_aside(Checkpointer.save, lambda _, state, **kw: state.step))

    def step_seconds(self, step: int) -> float:
        """From the end of the step before (or, for a run's first step, the start of the run's loop) to the end of
        this step's work, without the saves and evaluations in between."""
        if step in self.loop_started:
            return self.ended[step] - self.loop_started[step]
        return self.ended[step] - self.ended[step - 1] - self.set_aside.get(step - 1, 0.0)


def test_each_logged_step_time_matches_a_wall_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every logged step's time, tokens/s and data wait are its own, within 10% of a wall clock around its work:
    with --metrics.log_freq 1 a step slowed by 0.6 s (2), one that waits 0.3 s for data (4), a checkpoint step (3)
    and an evaluation (4), both read at once, and the last step (5); then a resume to step 7 with --metrics.log_freq
    10 logs its first step (6) and its last (7). The meter once timed a step from one loss read to the next, which
    gave such steps a window of about zero (tps 71,559 on 2 cores) and the next one too much."""
    clock = StepWallClock(monkeypatch, slow_steps={2: 0.6}, slow_data={4: 0.3})
    flags = ["--checkpoint.enable", "--checkpoint.interval", "3", "--validation.enable", "--validation.freq", "4",
             "--validation.steps", "2", "--lr_scheduler.warmup_steps", "2"]
    build_trainer(tmp_path, "--training.steps", "5", *flags).run()
    build_trainer(tmp_path, "--training.steps", "7", *flags, "--metrics.log_freq", "10").run()
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7]
    tokens_per_step = 4 * 64
    for record in records:
        step, wall = record["step"], clock.step_seconds(record["step"])
        assert record["step_time_min_s"] == record["step_time_max_s"] == pytest.approx(wall, rel=0.1), (step, wall)
        assert record["tps"] == pytest.approx(tokens_per_step / wall, rel=0.1), step
        assert record["data_wait_pct"] == pytest.approx(100 * clock.data_wait[step] / wall, rel=0.1, abs=0.5), step
    assert clock.step_seconds(2) > 0.7 and clock.data_wait[4] > 0.3


def test_same_seed_same_losses(tmp_path: Path) -> None:
    build_trainer(tmp_path / "a", "--training.steps", "3").run()
    build_trainer(tmp_path / "b", "--training.steps", "3").run()
    assert [r["loss"] for r in read_metrics(tmp_path / "a")] == [r["loss"] for r in read_metrics(tmp_path / "b")]


def test_gradient_accumulation_matches_one_big_batch(tmp_path: Path) -> None:
    """Two micro-batches of 2 read the same 4 sequences as one batch of 4: same losses and weights."""
    big = build_trainer(tmp_path / "big", "--training.steps", "3")
    big.run()
    accumulated = build_trainer(tmp_path / "acc", "--training.steps", "3", "--training.local_batch_size", "2",
                                "--training.global_batch_size", "4")
    accumulated.run()
    assert accumulated.training.grad_accumulation_steps == 2
    big_losses = [r["loss"] for r in read_metrics(tmp_path / "big")]
    acc_losses = [r["loss"] for r in read_metrics(tmp_path / "acc")]
    torch.testing.assert_close(acc_losses, big_losses, rtol=1e-5, atol=1e-5)
    for p_big, p_acc in zip(big.training.model.parameters(), accumulated.training.model.parameters()):
        torch.testing.assert_close(p_acc, p_big, rtol=1e-4, atol=1e-5)


PEAK_LR, MIN_LR_FACTOR = 1e-3, 0.1
WARMUP = [PEAK_LR * 1 / 3, PEAK_LR * 2 / 3]  # 2 warmup steps: (i + 1) / (warmup + 1) of the peak


def decayed(curve: float) -> float:
    """The lr at `curve` (1 at the peak, 0 at the end of the decay) above the floor."""
    return PEAK_LR * (MIN_LR_FACTOR + (1 - MIN_LR_FACTOR) * curve)


QUARTERS = (1 / 4, 2 / 4, 3 / 4, 1)  # decay progress over the 4 steps after warmup


@pytest.mark.parametrize("flags, expected", [
    ([], WARMUP + [decayed(1 - p) for p in QUARTERS]),
    (["--lr_scheduler.decay_type", "sqrt"], WARMUP + [decayed(1 - math.sqrt(p)) for p in QUARTERS]),
    (["--lr_scheduler.decay_type", "cosine"], WARMUP + [decayed(0.5 * (1 + math.cos(math.pi * p))) for p in QUARTERS]),
    # WSD: the last half of all 6 steps decays, the step between warmup and decay stays at the peak
    (["--lr_scheduler.decay_ratio", "0.5"], WARMUP + [PEAK_LR] + [decayed(1 - p) for p in (1 / 3, 2 / 3, 1)]),
], ids=["linear", "sqrt", "cosine", "decay_ratio"])
def test_lr_follows_warmup_and_decay(tmp_path: Path, flags: list[str], expected: list[float]) -> None:
    """The lr each step trained with, against the schedule's definition: linear warmup, then the decay curve."""
    build_trainer(tmp_path, "--training.steps", "6", "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.min_lr_factor",
                  str(MIN_LR_FACTOR), "--optimizer.lr", str(PEAK_LR), *flags).run()
    torch.testing.assert_close([r["lr"] for r in read_metrics(tmp_path)], expected)


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_adds_weight_decay_to_the_gradient_adamw_decouples_it(tmp_path: Path, name: str) -> None:
    """One optimizer step against both definitions. On the first step Adam's m / sqrt(v) is g / |g| (bias
    corrected), so Adam moves w by lr (g + wd w) / (|g + wd w| + eps), and AdamW by lr g / (|g| + eps) + lr wd w."""
    weight_decay = 0.5
    trainer = build_trainer(tmp_path, "--training.steps", "10", "--lr_scheduler.warmup_steps", "0", "--optimizer.lr",
                            "1e-2", "--optimizer.name", name, "--optimizer.weight_decay", str(weight_decay),
                            "--optimizer.decay_norm_and_bias", "--optimizer.decay_embeddings")
    before = {fqn: p.detach().clone() for fqn, p in trainer.training.model.named_parameters()}
    trainer.step += 1
    trainer.train_step(iter(trainer.dataloader))
    lr, eps = trainer.current_lr, trainer.cfg.optimizer.eps
    differs_from_other = False
    for fqn, param in trainer.training.model.named_parameters():
        w, g = before[fqn], param.grad  # the clipped gradient the optimizer stepped with
        with_decay = g + weight_decay * w
        adam = w - lr * with_decay / (with_decay.abs() + eps)
        adamw = w - lr * g / (g.abs() + eps) - lr * weight_decay * w
        want, other = (adam, adamw) if name == "Adam" else (adamw, adam)
        torch.testing.assert_close(param.detach(), want, rtol=0, atol=1e-6, msg=fqn)
        differs_from_other |= not torch.allclose(param.detach(), other, rtol=0, atol=1e-6)
    assert differs_from_other, "the two optimizers' steps must differ for this test to tell them apart"


@pytest.fixture
def deterministic_algorithms_restored() -> Iterator[None]:
    """Start with torch's deterministic-algorithms mode off; restore its setting afterwards (it is process-wide)."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(previous)


def test_deterministic_allows_only_deterministic_algorithms(tmp_path: Path, deterministic_algorithms_restored) -> None:
    """--training.deterministic turns on torch's deterministic mode, in which an op without a deterministic
    implementation (put_ with repeated indices) raises instead of running; the losses are the default run's."""
    build_trainer(tmp_path / "default", "--training.steps", "2").run()
    torch.zeros(2).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))
    build_trainer(tmp_path / "deterministic", "--training.steps", "2", "--training.deterministic").run()
    with pytest.raises(RuntimeError, match="put_ does not have a deterministic implementation"):
        torch.zeros(2).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))
    assert read_metrics(tmp_path / "deterministic")[-1]["loss"] == read_metrics(tmp_path / "default")[-1]["loss"]


def test_nan_loss_stops_at_that_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = build_trainer(tmp_path, "--training.steps", "10")
    nan_at(trainer, range(3, 11), monkeypatch.setattr)  # from step 3 on, as a diverging run
    with pytest.raises(NonFiniteLossError) as err:
        trainer.run()
    message = str(err.value)
    last_finite = read_metrics(tmp_path)[-1]["loss"]
    assert "loss is nan at step 3" in message and f"{last_finite:.4f}" in message
    assert "--optimizer.lr" in message and "first non-finite gradient is in" in message
    assert trainer.step == 3
    first_param = next(trainer.training.model.parameters())
    assert trainer.training.optimizer.state[first_param]["step"].item() == 2  # no step on the nan


@pytest.mark.parametrize("model", [[], ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]],
                         ids=["dense", "moe"])
def test_the_step_loop_reads_a_step_only_once_the_next_is_queued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   model: list[str]) -> None:
    """No blocking read in the step loop: over a whole run that logs every step (with a mixture of experts' load
    too), the host reads no tensor's values (HostReads: .item(), .tolist(), .cpu(), .to("cpu"), data-dependent
    sizes, whatever the device) except through each step's Readbacks (the loss's, and the expert counts'), which
    the loop reads while the step after it is queued (trainer.step is one ahead), and the last step's at the end of
    the run. Expert parallel's reads: tests/test_parallel.py."""
    trainer = build_trainer(tmp_path, "--training.steps", "6", *model)
    with counting_host_reads(trainer, monkeypatch) as (reads, read_at):
        trainer.run()
    assert reads.reads == []
    readbacks_per_step = 2 if model else 1
    assert read_at == [step for step in [2, 3, 4, 5, 6, 6] for _ in range(readbacks_per_step)]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(len(r.get("tokens_per_expert", ())) == (6 if model else 0) for r in records)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode needs a GPU")
def test_the_step_loop_never_synchronizes_a_cuda_device(tmp_path: Path) -> None:
    """Under torch.cuda.set_sync_debug_mode("error") every synchronizing call (a read, a blocking copy, an op whose
    output size depends on data) raises. Steps 2 to 5, once the first step has set the optimizer state up."""
    trainer = build_trainer(tmp_path, "--training.steps", "5")
    data_iterator = iter(trainer.dataloader)
    trainer.step += 1
    trainer.train_step(data_iterator)
    trainer.finish_step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            trainer.step += 1
            trainer.train_step(data_iterator)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert trainer.finish_step().step == 5


def test_garbage_is_collected_on_schedule_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--training.gc_freq 2 over 5 steps: automatic collection is off while training, generation 1 is collected
    before the first step and after steps 2 and 4, the pauses are in the metrics, and collection is back on after."""
    trainer = build_trainer(tmp_path, "--training.steps", "5", "--training.gc_freq", "2")
    collections: list[tuple[int, int]] = []
    real_collect = gc.collect

    def collect(generation: int = 2) -> int:
        collections.append((trainer.step, generation))
        return real_collect(generation)

    monkeypatch.setattr(gc, "collect", collect)
    enabled_during_steps = set()
    real_train_step = trainer.train_step

    def train_step(data_iterator: Iterator) -> object:
        enabled_during_steps.add(gc.isenabled())
        return real_train_step(data_iterator)

    monkeypatch.setattr(trainer, "train_step", train_step)
    assert gc.isenabled()
    trainer.run()
    assert gc.isenabled() and enabled_during_steps == {False}
    assert collections == [(0, 1), (2, 1), (4, 1)]
    # A record has the pauses since the previous one; step N is logged once step N + 1 is queued, after N's collection.
    pauses = {r["step"]: r["gc_pause_s"] for r in read_metrics(tmp_path)}
    assert pauses[1] > 0 and pauses[2] > 0 and pauses[3] == 0 and pauses[4] > 0 and pauses[5] == 0


def test_nonfinite_grad_is_named() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model[1].weight.grad[0, 0] = float("inf")
    error = stop_error(7, nonfinite_reason(2.5, float("inf")), 2.4, model, stop_hints([], False, 1.0))
    assert re.search(r"gradient norm is inf .* step 7.*in 1\.weight", str(error)), error


def test_hint_names_precision_casts_with_converters_and_compile() -> None:
    assert any("TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1" in h for h in stop_hints(["float8"], True, 1.0))
    assert not any("TORCHINDUCTOR" in h for h in stop_hints([], True, 1.0))
    assert any("--training.max_norm 1.0" in h for h in stop_hints([], False, 0.0))


def test_tensorboard_and_profiler_write_files(tmp_path: Path) -> None:
    build_trainer(tmp_path, "--training.steps", "4", "--metrics.enable_tensorboard", "--profiling.enable_profiling",
                  "--profiling.profile_freq", "2").run()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert list((tmp_path / "profile_traces").glob("iteration_*/rank0_trace.json"))


def test_bf16_autocast_trains(tmp_path: Path) -> None:
    build_trainer(tmp_path, "--training.steps", "2", "--training.mixed_precision_param", "bfloat16").run()
    assert all(math.isfinite(r["loss"]) for r in read_metrics(tmp_path))


def test_compile_matches_eager(tmp_path: Path) -> None:
    """Every block is compiled and dynamo really traced it: two graphs, one that all blocks share and one for the
    loss (the loss alone would be one). The losses are eager's. At the debug config's own batch (8 x 256 tokens),
    which the README's compiled command trains too: inductor's on-disk cache then compiles these graphs once per
    suite (tests/test_doc_commands.py runs that command first)."""
    debug_batch = ["--training.steps", "3", "--training.seq_len", "256", "--training.local_batch_size", "8"]
    build_trainer(tmp_path / "eager", *debug_batch).run()
    torch._dynamo.reset()  # compile afresh: graphs cached by an earlier test would leave nothing to count
    counters.clear()
    compiled = build_trainer(tmp_path / "compiled", *debug_batch, "--training.compile")
    compiled.run()
    assert all(block._compiled_call_impl is not None for block in compiled.training.model.layers.values())
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    eager_losses = [r["loss"] for r in read_metrics(tmp_path / "eager")]
    compiled_losses = [r["loss"] for r in read_metrics(tmp_path / "compiled")]
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-4, atol=1e-4)


class OpCounter(TorchDispatchMode):
    """Counts aten op calls below autograd: forward, backward and activation recompute alike."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func] += 1
        return func(*args, **(kwargs or {}))


# A step without recompute: 7 matmuls per block (wq wk wv wo w1 w3 w2) and the output projection in forward,
# two per matmul (input and weight gradients) in backward, and the output projection once more there (the
# chunked loss recomputes its one chunk of 256 tokens instead of keeping the logits).
STEP_MATMULS = 3 * (7 * NUM_LAYERS + 1) + 1
ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


KEEP_NO_ATTENTION = ["--activation_checkpoint.save_attention", "false"]
EVERY_2 = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"]


@pytest.mark.parametrize("flags, wrapped, attention_calls, recomputed_matmuls", [
    ([], [], NUM_LAYERS, 0),
    # Full: each block's forward runs again in backward, up to its last matmul (w2), whose output backward
    # does not need: non-reentrant checkpointing stops recomputing there. Attention outputs are kept.
    (["--activation_checkpoint.mode", "full"], list(range(NUM_LAYERS)), NUM_LAYERS, 6 * NUM_LAYERS),
    # Without save_attention, attention runs again too.
    (["--activation_checkpoint.mode", "full", *KEEP_NO_ATTENTION], list(range(NUM_LAYERS)), 2 * NUM_LAYERS,
     6 * NUM_LAYERS),
    # Selective by op: attention outputs are kept, every second matmul of a block (wk, wo, w3) is recomputed.
    (["--activation_checkpoint.mode", "selective"], list(range(NUM_LAYERS)), NUM_LAYERS, 3 * NUM_LAYERS),
    (["--activation_checkpoint.mode", "selective", *KEEP_NO_ATTENTION], list(range(NUM_LAYERS)), NUM_LAYERS,
     3 * NUM_LAYERS),
    # Every 2nd block, fully.
    (EVERY_2, list(range(0, NUM_LAYERS, 2)), NUM_LAYERS, 6 * (NUM_LAYERS // 2)),
    ([*EVERY_2, *KEEP_NO_ATTENTION], list(range(0, NUM_LAYERS, 2)), NUM_LAYERS + NUM_LAYERS // 2,
     6 * (NUM_LAYERS // 2)),
], ids=["none", "full", "full-recompute-attention", "selective-op", "selective-op-save-attention-ignored",
        "selective-every-2", "selective-every-2-recompute-attention"])
def test_activation_checkpointing_recomputes_in_backward(tmp_path: Path, flags: list[str], wrapped: list[int],
                                                         attention_calls: int, recomputed_matmuls: int) -> None:
    """The trainer's blocks are checkpoint-wrapped as the mode says, and one step runs exactly the forward ops
    that mode recomputes a second time."""
    trainer = build_trainer(tmp_path, "--training.steps", "1", *flags)
    layers = trainer.training.model.layers
    assert [int(i) for i, block in layers.items() if isinstance(block, CheckpointWrapper)] == wrapped
    trainer.step += 1
    with OpCounter() as ops:
        trainer.train_step(iter(trainer.dataloader))
    assert ops.calls[ATTENTION] == attention_calls
    assert ops.calls[torch.ops.aten.mm.default] == STEP_MATMULS + recomputed_matmuls
