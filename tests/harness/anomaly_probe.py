"""train.py whose loss is NaN at chosen steps, for the anomaly tests: the same entry point and exit codes, run by
titan.launch like run_train.sh runs train.py.

    NAN_STEPS=3,8 python -m titan.launch --standalone --nproc_per_node 2 tests/harness/anomaly_probe.py [titan flags]

Every rank multiplies its loss by NaN at the steps listed in NAN_STEPS (comma-separated), as a diverging run
would make it; each time the loop reaches such a step, also after a rollback.
"""

import os
import sys
from pathlib import Path

# Run as a script (torchrun, titan.launch): the repository root holds titan and train.py, tests/ the harness package.
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from titan.exits import exit_process, run_main  # noqa: E402
from titan.metrics.log import init_logger  # noqa: E402
from titan.parallel.dims import destroy_distributed  # noqa: E402
from titan.train.trainer import Trainer  # noqa: E402
from titan.validate import load_job_config  # noqa: E402

from harness.nan_injection import nan_at  # noqa: E402


def train(argv: list[str]) -> None:
    init_logger()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = Trainer(load_job_config(argv, world_size), world_size)
    nan_at(trainer, {int(step) for step in os.environ["NAN_STEPS"].split(",")})
    trainer.run()


if __name__ == "__main__":
    exit_process(run_main(lambda: train(sys.argv[1:]),
                          on_exit=lambda ranks_agree: destroy_distributed(wait_for_peers=ranks_agree)))
