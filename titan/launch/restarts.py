"""Which failed attempts the launcher restarts (--max-restarts), and what it says about each: RestartPolicy decides
and returns a RestartDecision, which the agent (agent.py) acts on and the launcher reports (__main__.py)."""

import json
import signal
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from titan.exits import EXIT_HUNG, EXIT_SAVE_FAILED, KNOWN_EXIT_CODES, NOT_RETRIED
from titan.launch.goodput_log import last_finished_step, record_failure
from titan.metrics.goodput import read_events
from titan.metrics.log import logger

FAILURE_KEY = "titan/failure"
"""Key, in one rendezvous round's store, holding what ended that round's attempt (the failing node writes it)."""
EXIT_MEANINGS = {1: "crashed", EXIT_HUNG: "hung", EXIT_SAVE_FAILED: "failed to save a checkpoint"}
"""What the retried exit codes say of a rank, for the restart messages (1: an uncaught error)."""


def exit_code(failure_code: int) -> int:
    """A rank's exit code as a shell reports it: a rank killed by signal N gives 128 + N."""
    return 128 - failure_code if failure_code < 0 else failure_code or 1


def first_explained_failure(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """(rank, failure) to report: the earliest rank that exited with a known stop's code (its message explains it),
    else the earliest failure. Peers of a stopped rank fail after it, but a signal can reorder that."""
    ordered = sorted(failures.items(), key=lambda item: item[1].timestamp)
    explained = [(rank, failure) for rank, failure in ordered if failure.exitcode in KNOWN_EXIT_CODES]
    return (explained or ordered)[0]


def describe_exit(failure: ProcessFailure) -> str:
    """'was killed by SIGKILL', 'exited with code 5 (hung)'."""
    if failure.exitcode < 0:
        return f"was killed by {signal.Signals(-failure.exitcode).name}"
    meaning = EXIT_MEANINGS.get(failure.exitcode)
    return f"exited with code {failure.exitcode}" + (f" ({meaning})" if meaning else "")


@dataclass(frozen=True)
class FailedAttempt:
    """What ended an attempt on one node: the rank to report, its exit code as a shell shows it, and a sentence
    for the messages ("rank 1 was killed by SIGKILL, after step 7")."""

    node: int
    """The group rank of the node whose ranks failed."""
    rank: int
    code: int
    text: str

    def notice(self) -> str:
        """This failure as the failing node tells the other nodes (FAILURE_KEY): JSON."""
        return json.dumps(asdict(self))


def failed_attempt(failures: dict[int, ProcessFailure], group_rank: int, dump_folder: Path) -> FailedAttempt:
    """The failure to report of an attempt whose ranks on the node of group rank `group_rank` failed."""
    rank, failure = first_explained_failure(failures)
    step = last_finished_step(read_events(dump_folder))
    text = (f"rank {rank} {describe_exit(failure)}, "
            + (f"after step {step}" if step is not None else "before finishing a step"))
    return FailedAttempt(node=group_rank, rank=rank, code=exit_code(failure.exitcode), text=text)


class Verdict(Enum):
    RESTART = "restart"
    """Every rank restarts and resumes from the newest complete checkpoint."""
    END = "end"
    """The job ends with the rank's code: no restarts allowed (--max-restarts 0), or a failure in NOT_RETRIED."""
    RESTARTS_SPENT = "restarts spent"
    """The failure would be retried, but every restart was used: the job ends with EXIT_RESTARTS_SPENT."""


@dataclass(frozen=True)
class RestartDecision:
    verdict: Verdict
    failure: FailedAttempt


@dataclass(frozen=True)
class RestartPolicy:
    """Which failed attempts the launcher's torchrun agent restarts (--max-restarts), and what it says about each.
    The agent on the node of group rank 0 also records each failure in the job's goodput log."""

    max_restarts: int
    dump_folder: Path

    def decide(self, failures: dict[int, ProcessFailure], remaining: int, group_rank: int) -> RestartDecision:
        """What to do after this node's ranks failed (`failures`), with `remaining` of the agent's restarts left;
        a restart is announced here."""
        failure = failed_attempt(failures, group_rank, self.dump_folder)
        if group_rank == 0:
            record_failure(self.dump_folder, failure.rank, failure.code)
        verdict = self.verdict(failure, remaining)
        if verdict is Verdict.RESTART:
            logger.warning(f"Restart {self.max_restarts - remaining + 1} of {self.max_restarts} (--max-restarts): "
                           f"{failure.text}. Every rank restarts and resumes from the newest complete checkpoint.")
        return RestartDecision(verdict, failure)

    def verdict(self, failure: FailedAttempt, remaining: int) -> Verdict:
        """Whether `failure` is retried, with `remaining` restarts left; a failure that ends the job says why."""
        if self.max_restarts == 0:
            return Verdict.END
        if failure.code in NOT_RETRIED:
            logger.error(f"Rank {failure.rank} exited with code {failure.code}, which ends the job without a restart "
                         f"(--max-restarts {self.max_restarts}): {NOT_RETRIED[failure.code]}.")
            return Verdict.END
        return Verdict.RESTART if remaining > 0 else Verdict.RESTARTS_SPENT

    def failed_elsewhere(self, round_store: dist.Store, group_rank: int) -> bool:
        """Whether another node's ranks failed in this attempt (the node of group rank `group_rank`, this one, has
        healthy ranks), which this node restarts with: torch's agent takes its membership-change path, told of the
        failed node's rejoin. It says so, and on the node of rank 0, which keeps the goodput log, records it."""
        if not round_store.check([FAILURE_KEY]):
            return False
        notice = FailedAttempt(**json.loads(round_store.get(FAILURE_KEY)))
        if notice.node == group_rank:
            return False
        if group_rank == 0:
            record_failure(self.dump_folder, notice.rank, notice.code)
        logger.warning(f"Restarting with the other nodes: {notice.text} on another node. Every rank restarts and "
                       f"resumes from the newest complete checkpoint.")
        return True
