"""torchrun for Titan: `python -m titan.launch [torchrun flags] train.py [titan flags]`.

It checks its own environment and the Titan flags once, in this process, before any rank starts: a mistake then
prints one message and exits 2 instead of failing in every rank. It then runs torchrun itself
(torch.distributed.run) and passes a failed rank's exit code through, without torchrun's own traceback: the rank
has already said what went wrong. `--help` shows torchrun's flags, then Titan's fields.

With --max-restarts N (MAX_RESTARTS for run_train.sh; default 0), a failed attempt is restarted, all ranks at once,
up to N times, each resuming from the newest complete checkpoint: a rank killed by a signal, a crash (1), a hang (5)
and a failed checkpoint save (6) are retried. A config or data mistake (2), a divergence (3) and a requested stop (4)
end the job at once with their code, since a restart would repeat them or undo the request. Each restart logs the
failing rank, its exit code or signal and the job's last finished step; a failure after the last restart ends the
job with code 7. This is torchrun's own agent, told which failures to retry (RestartPolicy), so multi-node jobs
restart through torchrun's rendezvous as usual (docs/production.md).

Stop signals (SIGTERM, SIGINT, SIGUSR1: titan.exits.STOP_SIGNALS) are passed on to every rank, which saves and
exits with code 4, and the launcher keeps waiting for the ranks and reports their code. torchrun on its own would
pass on SIGTERM and SIGINT (not SIGUSR1, which would kill it), SIGKILL the ranks still running 30 s later
(--shutdown_timeout), and exit 1 with a traceback. Here only the scheduler's own grace period bounds the save.
"""

import contextlib
import json
import logging
import os
import signal
import sys
import time
from argparse import ArgumentParser, Namespace
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import torch.distributed as dist
import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.run import determine_local_world_size, get_args_parser, run

from titan.config.check import load_job_config
from titan.config.errors import ConfigError
from titan.config.load import parse_args as parse_titan_args
from titan.config.print_config import print_config
from titan.dry_run import dry_run
from titan.exits import (
    EXIT_HUNG,
    EXIT_RESTARTS_SPENT,
    EXIT_SAVE_FAILED,
    KNOWN_EXIT_CODES,
    NOT_RETRIED,
    STOP_SIGNALS,
    run_main,
)
from titan.metrics.goodput import (
    ATTEMPT_ENV,
    LAUNCH_TIME_ENV,
    EventLog,
    measure_goodput,
    process_start_time,
    read_events,
    summary,
)
from titan.metrics.log import init_logger, logger, logging_ranks

HELP_FLAGS = ("-h", "--help")


def nodes_and_processes(args: Namespace) -> tuple[int, int]:
    """(nodes, processes per node) as torchrun will read them: the upper end of an elastic `min:max` node range,
    and torchrun's own reading of --nproc_per_node (gpu/auto: one per visible GPU, cpu: one per core)."""
    problems = []
    nodes = args.nnodes.split(":")[-1]
    if not nodes.isdigit() or int(nodes) < 1:
        problems.append(f"--nnodes {args.nnodes!r} must be a whole number of nodes, at least 1, or a range "
                        f"min:max such as 1:4.")
    try:
        per_node = determine_local_world_size(args.nproc_per_node)
    except ValueError as error:
        per_node = 0
        problems.append(f"--nproc_per_node {args.nproc_per_node!r} (NGPU for run_train.sh) must be a whole number of "
                        f"processes, at least 1, or one of gpu, cpu, auto (torchrun: {error}). Try NGPU=1.")
    else:
        if per_node < 1:
            problems.append(f"--nproc_per_node {args.nproc_per_node!r} (NGPU for run_train.sh) must be at least 1. "
                            f"Try NGPU=1.")
    if problems:
        raise ConfigError(problems)
    return int(nodes), per_node


def check_log_ranks(world_size: int) -> None:
    """LOG_RANK must name a rank of this job, or no rank would print the training log."""
    ranks = logging_ranks()
    if min(ranks) >= world_size:
        raise ConfigError(f"LOG_RANK={','.join(map(str, sorted(ranks)))} names no rank of this job (ranks 0 to "
                          f"{world_size - 1}), so no rank would print the training log. Use LOG_RANK=0 (the default).")


def exit_code(failure_code: int) -> int:
    """A rank's exit code as a shell reports it: a rank killed by signal N gives 128 + N."""
    return 128 - failure_code if failure_code < 0 else failure_code or 1


def first_explained_failure(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """(rank, failure) to report: the earliest rank that exited with a known stop's code (its message explains it),
    else the earliest failure. Peers of a stopped rank fail after it, but a signal can reorder that."""
    ordered = sorted(failures.items(), key=lambda item: item[1].timestamp)
    explained = [(rank, failure) for rank, failure in ordered if failure.exitcode in KNOWN_EXIT_CODES]
    return (explained or ordered)[0]


EXIT_MEANINGS = {1: "crashed", EXIT_HUNG: "hung", EXIT_SAVE_FAILED: "failed to save a checkpoint"}
"""What the retried exit codes say of a rank, for the restart messages (1: an uncaught error)."""


def describe_exit(failure: ProcessFailure) -> str:
    """'was killed by SIGKILL', 'exited with code 5 (hung)'."""
    if failure.exitcode < 0:
        return f"was killed by {signal.Signals(-failure.exitcode).name}"
    meaning = EXIT_MEANINGS.get(failure.exitcode)
    return f"exited with code {failure.exitcode}" + (f" ({meaning})" if meaning else "")


def last_finished_step(events: list[dict]) -> int | None:
    """The last step rank 0 finished, from the goodput log's events; None before any (or with the log on another
    node)."""
    steps = [event["step"] for event in events if event.get("event") == "step"]
    return steps[-1] if steps else None


class RestartPolicy:
    """Which failed attempts the launcher's torchrun agent restarts (--max-restarts), and what it says about each.
    The agent on the node of group rank 0 also records each failure in the job's goodput log."""

    def __init__(self, max_restarts: int, dump_folder: Path) -> None:
        self.max_restarts = max_restarts
        self.dump_folder = dump_folder
        self.restarting = False
        """The attempt that just failed is being restarted (its survivors are killed, not asked to stop)."""
        self.budget_spent = False
        self.hosts_rank_0 = False
        self.last_failure = ""
        self.failure_notice = ""
        """What this node's agent tells the others of its ranks' last failure (FAILURE_KEY): JSON."""

    def restarts_left(self, failures: dict[int, ProcessFailure], remaining: int, group_rank: int) -> int:
        """The agent's restarts left after this failed attempt: none for a failure that is not retried."""
        rank, failure = first_explained_failure(failures)
        code = exit_code(failure.exitcode)
        self.hosts_rank_0 = group_rank == 0
        if self.hosts_rank_0:
            self.record_failure(rank, code)
        step = last_finished_step(read_events(self.dump_folder))
        self.last_failure = (f"rank {rank} {describe_exit(failure)}, "
                             + (f"after step {step}" if step is not None else "before finishing a step"))
        self.failure_notice = json.dumps({"node": group_rank, "rank": rank, "code": code, "text": self.last_failure})
        self.restarting = False
        if self.max_restarts == 0:
            return 0
        if code in NOT_RETRIED:
            logger.error(f"Rank {rank} exited with code {code}, which ends the job without a restart "
                         f"(--max-restarts {self.max_restarts}): {NOT_RETRIED[code]}.")
            return 0
        if remaining == 0:
            self.budget_spent = True
            return 0
        logger.warning(f"Restart {self.max_restarts - remaining + 1} of {self.max_restarts} (--max-restarts): "
                       f"{self.last_failure}. Every rank restarts and resumes from the newest complete checkpoint.")
        self.restarting = True
        return remaining

    def failed_elsewhere(self, round_store: dist.Store, group_rank: int) -> bool:
        """Whether another node's ranks failed in this attempt (the node of group rank `group_rank`, this one, has
        healthy ranks), which this node restarts with: torch's agent takes its membership-change path, told of the
        failed node's rejoin. It says so, and on the node of rank 0, which keeps the goodput log, records it."""
        if not round_store.check([FAILURE_KEY]):
            return False
        notice = json.loads(round_store.get(FAILURE_KEY))
        if notice["node"] == group_rank:
            return False
        if group_rank == 0:
            self.record_failure(notice["rank"], notice["code"])
        logger.warning(f"Restarting with the other nodes: {notice['text']} on another node. Every rank restarts and "
                       f"resumes from the newest complete checkpoint.")
        return True

    def record_failure(self, rank: int, code: int) -> None:
        """Append the failure to the job's goodput log (the node of group rank 0 does, once per failure)."""
        events = EventLog(self.dump_folder, enabled=True)
        events.write("failure", rank=rank, code=code)
        events.close()


def stat_fields(stat: Path) -> list[str] | None:
    """The fields of a /proc/<pid>/stat file after "pid (name)": state, ppid, ...; None once the process is gone."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_state(pid: int) -> str | None:
    """The state letter of a process (R, S, T stopped, Z exited and not yet reaped), None if it is gone."""
    fields = stat_fields(Path(f"/proc/{pid}/stat"))
    return fields[0] if fields else None


def kill_stopped_ranks_after_an_exit(pids: dict[int, int]) -> None:
    """SIGKILL the ranks stopped by SIGSTOP once another rank has exited. torchrun stops the rest of a failed attempt
    with SIGTERM and waits 30 s before SIGKILL, but a stopped process does not act on SIGTERM: it would hold the
    restart (or the job's end) for those 30 s."""
    states = {local_rank: process_state(pid) for local_rank, pid in pids.items()}
    if "Z" not in states.values():
        return
    for local_rank, state in states.items():
        if state == "T":
            logger.warning(f"Local rank {local_rank} is stopped (SIGSTOP) while another rank has exited: killing it.")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[local_rank], signal.SIGKILL)


ATTEMPTS_KEY = "titan/attempts"
"""Key, in the rendezvous store that every round shares, counting the job's attempts so far."""
ATTEMPT_KEY = "titan/attempt"
"""Key, in one rendezvous round's store, holding that round's attempt number."""
FAILURE_KEY = "titan/failure"
"""Key, in one rendezvous round's store, holding what ended that round's attempt (the failing node writes it)."""


def agree_on_attempt(round_store: dist.Store, group_rank: int) -> int:
    """The number of the attempt this rendezvous round starts, the same on every node: the node of group rank 0
    counts rounds in the store every round shares and tells the others through the round's own store. Each node's
    torchrun agent counts restarts of its own (TORCHELASTIC_RESTART_COUNT): only the node whose ranks failed counts
    one, the others restart through the membership-change path, which counts none. A round that a node joining an
    elastic job (--nnodes 3:4) starts, with no failure, is a new attempt too: every rank starts again in it."""
    if group_rank == 0:
        attempt = round_store.underlying_store.add(ATTEMPTS_KEY, 1) - 1
        round_store.set(ATTEMPT_KEY, str(attempt))
        return attempt
    return int(round_store.get(ATTEMPT_KEY))


def restarting_agent(policy: RestartPolicy) -> type[LocalElasticAgent]:
    """torchrun's agent, restarting only the failures `policy` retries."""

    class RestartingAgent(LocalElasticAgent):
        """Numbers each attempt as every node does (agree_on_attempt), for its ranks (ATTEMPT_ENV). Stops a failed
        attempt's surviving ranks with SIGKILL when restarting, also on a node whose own ranks are healthy but
        another node's failed: their state is thrown away, and a rank stuck in a collective or stopped (SIGSTOP)
        would otherwise hold the restart for torchrun's 30 s shutdown timeout."""

        def _rendezvous(self, worker_group: WorkerGroup) -> None:
            super()._rendezvous(worker_group)
            os.environ[ATTEMPT_ENV] = str(agree_on_attempt(worker_group.store, worker_group.group_rank))

        def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
            if self._pcontext is not None:
                kill_stopped_ranks_after_an_exit(self._pcontext.pids())
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.FAILED:
                # torch's own agent turns restarts off the same way (a rank stuck in uninterruptible sleep).
                self._remaining_restarts = policy.restarts_left(result.failures, self._remaining_restarts,
                                                                worker_group.group_rank)
                worker_group.store.set(FAILURE_KEY, policy.failure_notice)
            return result

        def _stop_workers(self, worker_group: WorkerGroup, *args: object, **kwargs: object) -> None:
            if policy.restarting or policy.failed_elsewhere(worker_group.store, worker_group.group_rank):
                policy.restarting = False
                self._shutdown(signal.SIGKILL)
            else:
                super()._stop_workers(worker_group, *args, **kwargs)

    return RestartingAgent


@contextlib.contextmanager
def using_agent(agent_class: type[LocalElasticAgent]) -> Iterator[None]:
    """Have torch.distributed.run build `agent_class`: its launch_agent constructs LocalElasticAgent by this module
    name and takes no other class."""
    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = agent_class
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original


def record_goodput_after_failure(dump_folder: Path) -> None:
    """Write the job's goodput record to the console and metrics.jsonl when its last attempt could not (it crashed,
    hung or was killed): the launcher's record is the last word on the job."""
    events = read_events(dump_folder)
    starts = [index for index, event in enumerate(events) if event.get("event") == "start"]
    if not starts or any(event.get("event") == "end" for event in events[starts[-1]:]):
        return
    record = measure_goodput(events, now=time.time()).record(last_finished_step(events) or 0)
    logger.info(summary(record))
    with (dump_folder / "metrics.jsonl").open("a") as file:
        file.write(json.dumps(record) + "\n")


def read_max_restarts_as_text(parser: ArgumentParser) -> None:
    """Have torchrun's parser keep --max-restarts as written, for read_max_restarts to read: as an int, a mistake
    would end in torchrun's usage text, which never names MAX_RESTARTS, the variable run_train.sh users set."""
    for action in parser._actions:  # argparse has no public way to look an option up
        if "--max-restarts" in action.option_strings:
            action.type = str


def check_restarts_across_nodes(args: Namespace, nodes: int) -> None:
    """In-job restarts of several nodes need a rendezvous in which every node's agent learns of another's failure
    and agrees on the next attempt (c10d's rounds); torchrun's static one has no rounds: a node restarts alone."""
    if args.max_restarts > 0 and nodes > 1 and args.rdzv_backend == "static":
        raise ConfigError(f"--max-restarts {args.max_restarts} across --nnodes {args.nnodes} needs --rdzv_backend c10d "
                          f"(with --rdzv_endpoint HEAD:PORT and --rdzv_id JOB_ID on every node): torchrun's static "
                          f"rendezvous restarts each node on its own, and the nodes never meet again.")


def read_max_restarts(text: str) -> int:
    """--max-restarts as written (read_max_restarts_as_text) as the count torchrun takes: 0 or more."""
    try:
        restarts = int(text)
    except ValueError:
        restarts = -1
    if restarts < 0:
        raise ConfigError(f"MAX_RESTARTS={text} (--max-restarts for python -m titan.launch) must be a whole number, 0 "
                          f"or more: how many times a failed job restarts from its newest checkpoint. Try "
                          f"MAX_RESTARTS=3.")
    return restarts


def child_pids(parent: int | None = None) -> list[int]:
    """The processes `parent` (default: this one) started, its ranks, from /proc (Linux, where schedulers send stop
    signals)."""
    me = os.getpid() if parent is None else parent
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = stat_fields(stat)
        if fields is not None and int(fields[1]) == me:  # None: it exited while we looked
            children.append(int(stat.parent.name))
    return children


def forward_to_ranks(signum: int, frame: FrameType | None) -> None:
    """Pass a stop signal on to every rank: each saves at its next step boundary and exits with code 4."""
    logger.warning(f"The launcher received {signal.Signals(signum).name} and passed it on to its ranks.")
    for pid in child_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


@contextlib.contextmanager
def forwarding_stop_signals(args: Namespace) -> Iterator[None]:
    """While the ranks run, the launcher passes STOP_SIGNALS on instead of torchrun (on Linux, which lists its
    children in /proc; elsewhere torchrun's own handling stays)."""
    if not sys.platform.startswith("linux"):
        yield
        return
    names = {sig.name for sig in STOP_SIGNALS}
    args.signals_to_handle = ",".join(name for name in args.signals_to_handle.split(",") if name.strip() not in names)
    previous = {signum: signal.signal(signum, forward_to_ranks) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def launch(argv: list[str]) -> int:
    init_logger()
    parser = get_args_parser()
    parser.prog = "python -m titan.launch"
    read_max_restarts_as_text(parser)
    if any(arg in HELP_FLAGS for arg in argv) and not any(arg.endswith(".py") for arg in argv):
        parser.print_help()
        print("\nTitan's fields (give them after train.py):\n")
        parse_titan_args(["--help"])
    args = parser.parse_args(argv)
    nodes, per_node = nodes_and_processes(args)
    world_size = nodes * per_node
    args.max_restarts = read_max_restarts(args.max_restarts)
    check_restarts_across_nodes(args, nodes)
    check_log_ranks(world_size)
    cfg = load_job_config(args.training_script_args, world_size)
    if cfg.job.print_config:
        print_config(cfg, world_size)  # no ranks: nothing runs
        return 0
    if cfg.job.dry_run:
        # No torchrun, whatever NGPU is: the job's first and last rank are simulated one after the other, each in a
        # process of its own (titan/estimate/gpu_rank.py).
        return dry_run(cfg, world_size, ranks=None)
    policy = RestartPolicy(args.max_restarts, Path(cfg.job.dump_folder))
    os.environ[LAUNCH_TIME_ENV] = f"{process_start_time():.3f}"  # the ranks date the launch's wall time from it
    # torchrun logs each failed rank at ERROR level; the rank's own message is the useful one.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        with forwarding_stop_signals(args), using_agent(restarting_agent(policy)):
            run(args)
    except ChildFailedError as error:
        rank, failure = first_explained_failure(error.failures)
        if policy.hosts_rank_0 and args.max_restarts > 0:
            record_goodput_after_failure(Path(cfg.job.dump_folder))
        if policy.budget_spent:
            logger.error(f"The job failed again after all {args.max_restarts} of its restarts (--max-restarts "
                         f"{args.max_restarts}; MAX_RESTARTS for run_train.sh): {policy.last_failure}. Its messages "
                         f"above say why. Fix what keeps failing, or allow more restarts. Exit code "
                         f"{EXIT_RESTARTS_SPENT}.")
            return EXIT_RESTARTS_SPENT
        code = exit_code(failure.exitcode)
        logger.error(f"Rank {rank} exited with code {code}; its messages above say why.")
        return code
    except RendezvousClosedError:
        # Another node's launcher ended the job (a failure it does not restart, or its budget spent) while this one
        # waited to restart with it: torchrun closes the rendezvous when an agent gives up.
        logger.error(f"Another node's launcher ended the job while this node waited to restart (last failure here: "
                     f"{policy.last_failure or 'none'}); its log says why.")
        return 1
    return 0


def main(argv: list[str]) -> int:
    return run_main(lambda: launch(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
