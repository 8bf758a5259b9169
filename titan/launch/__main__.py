"""`python -m titan.launch`: check the job, print or dry-run it if asked, else run its ranks under torchrun with
Titan's restarts and end with the code that says how they ended (titan/launch/__init__.py has the whole story)."""

import logging
import os
import sys
from argparse import Namespace
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.run import run

from titan.dry_run import print_or_dry_run
from titan.exits import EXIT_RESTARTS_SPENT, run_main
from titan.launch.agent import restarting_agent, using_agent
from titan.launch.cli import parse_launch_args
from titan.launch.goodput_log import record_goodput_after_failure
from titan.launch.restarts import RestartDecision, RestartPolicy, Verdict
from titan.launch.signals import forwarding_stop_signals
from titan.metrics.goodput import LAUNCH_TIME_ENV, process_start_time
from titan.metrics.log import init_logger, logger
from titan.validate import load_job_config


def launch(argv: list[str]) -> int:
    """The job's exit code: 0 when it finished (or was printed or dry-run), else its failed rank's code, or 7 when
    its restarts ran out."""
    init_logger()
    args, world_size = parse_launch_args(argv)
    cfg = load_job_config(args.training_script_args, world_size)
    if print_or_dry_run(cfg, world_size, rank=None):
        return 0
    return run_ranks(args, Path(cfg.job.dump_folder))


def run_ranks(args: Namespace, dump_folder: Path) -> int:
    """Run torchrun (`args`) with the restarting agent and this launcher passing stop signals on; the job's code."""
    decisions: list[RestartDecision] = []
    agent_class = restarting_agent(RestartPolicy(args.max_restarts, dump_folder), decisions.append)
    os.environ[LAUNCH_TIME_ENV] = f"{process_start_time():.3f}"  # the ranks date the launch's wall time from it
    # torchrun logs each failed rank at ERROR level; the rank's own message is the useful one.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        with forwarding_stop_signals(args), using_agent(agent_class):
            run(args)
    except ChildFailedError:
        # torchrun raises it after this node's agent decided on the failed attempt it reports, last.
        return failed_job_code(decisions[-1], args.max_restarts, dump_folder)
    except RendezvousClosedError:
        # Another node's launcher ended the job (a failure it does not restart, or its budget spent) while this one
        # waited to restart with it: torchrun closes the rendezvous when an agent gives up.
        last_failure = decisions[-1].failure.text if decisions else "none"
        logger.error(f"Another node's launcher ended the job while this node waited to restart (last failure here: "
                     f"{last_failure}); its log says why.")
        return 1
    return 0


def failed_job_code(decision: RestartDecision, max_restarts: int, dump_folder: Path) -> int:
    """Report a job that ended with this node's failed attempt (`decision`, which did not restart it): 7 when its
    restarts were spent, else the failed rank's code."""
    failure = decision.failure
    if failure.node == 0 and max_restarts > 0:
        record_goodput_after_failure(dump_folder)
    if decision.verdict is Verdict.RESTARTS_SPENT:
        logger.error(f"The job failed again after all {max_restarts} of its restarts (--max-restarts {max_restarts}; "
                     f"MAX_RESTARTS for run_train.sh): {failure.text}. Its messages above say why. Fix what keeps "
                     f"failing, or allow more restarts. Exit code {EXIT_RESTARTS_SPENT}.")
        return EXIT_RESTARTS_SPENT
    logger.error(f"Rank {failure.rank} exited with code {failure.code}; its messages above say why.")
    return failure.code


def main(argv: list[str]) -> int:
    return run_main(lambda: launch(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
