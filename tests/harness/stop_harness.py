"""train.py with one thing done at the end of a chosen step on a chosen rank, for the preemption tests (hangs and
kills come from the fault harness, [fault]: tests/test_restarts.py).

    TITAN_TEST_ACTION=STEP:RANK:ACTION python -m titan.launch --nproc_per_node 2 tests/harness/stop_harness.py \
        [titan flags]

ACTION is what rank RANK does right after its step STEP, before the step boundary:
    signal    send itself SIGTERM (the real handler and the real loop take it from there)
    launcher  send SIGTERM to the launcher (its parent), as a scheduler would, and wait until the launcher has
              passed it on to this rank
Without TITAN_TEST_ACTION it is train.py. Everything else is train.py's: the config check, the Trainer, run_main
and its exit codes.
"""

import os
import signal
import sys
import time
from pathlib import Path

# Run as a script (torchrun, titan.launch): the repository root holds titan and train.py, tests/ the harness package.
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import train  # noqa: E402
from titan.exits import exit_process  # noqa: E402
from titan.metrics.log import current_rank  # noqa: E402
from titan.train.trainer import Trainer  # noqa: E402


def wait_for_forwarded_signal(trainer: Trainer) -> None:
    while trainer.stopper.signals.signum is None:
        time.sleep(0.01)


def act(trainer: Trainer, action: str) -> None:
    if action == "signal":
        os.kill(os.getpid(), signal.SIGTERM)
    elif action == "launcher":
        os.kill(os.getppid(), signal.SIGTERM)
        wait_for_forwarded_signal(trainer)
    else:
        raise ValueError(f"TITAN_TEST_ACTION names an unknown action {action!r}")


def install(step: int, rank: int, action: str) -> None:
    """Wrap Trainer.train_step so that rank `rank` does `action` right after step `step`."""
    train_step = Trainer.train_step

    def train_step_then_act(self: Trainer, data_iterator) -> tuple:
        result = train_step(self, data_iterator)
        if self.step == step and current_rank() == rank:
            act(self, action)
        return result

    Trainer.train_step = train_step_then_act


if __name__ == "__main__":
    if "TITAN_TEST_ACTION" in os.environ:
        at_step, at_rank, what = os.environ["TITAN_TEST_ACTION"].split(":")
        install(int(at_step), int(at_rank), what)
    exit_process(train.main(sys.argv[1:]))
