"""torchrun's agent as the launcher runs it: attempts numbered alike on every node, failed attempts restarted as
RestartPolicy decides, and the ranks of a restarted attempt killed at once; and how torchrun is made to build it."""

import contextlib
import os
import signal
from collections.abc import Callable, Iterator

import torch.distributed as dist
import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from titan.launch.procs import process_state
from titan.launch.restarts import FAILURE_KEY, RestartDecision, RestartPolicy, Verdict
from titan.metrics.goodput import ATTEMPT_ENV
from titan.metrics.log import logger

ATTEMPTS_KEY = "titan/attempts"
"""Key, in the rendezvous store that every round shares, counting the job's attempts so far."""
ATTEMPT_KEY = "titan/attempt"
"""Key, in one rendezvous round's store, holding that round's attempt number."""


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


def restarting_agent(policy: RestartPolicy,
                     on_decision: Callable[[RestartDecision], None]) -> type[LocalElasticAgent]:
    """torchrun's agent, restarting only the failures `policy` retries; each decision also goes to `on_decision`,
    for the launcher to report how the job ended."""

    class RestartingAgent(LocalElasticAgent):
        """Numbers each attempt as every node does (agree_on_attempt), for its ranks (ATTEMPT_ENV). Stops a failed
        attempt's surviving ranks with SIGKILL when restarting, also on a node whose own ranks are healthy but
        another node's failed: their state is thrown away, and a rank stuck in a collective or stopped (SIGSTOP)
        would otherwise hold the restart for torchrun's 30 s shutdown timeout."""

        restart_pending = False
        """The attempt just decided on restarts: torch's agent stops its ranks next, which then kills them."""

        def _rendezvous(self, worker_group: WorkerGroup) -> None:
            super()._rendezvous(worker_group)
            os.environ[ATTEMPT_ENV] = str(agree_on_attempt(worker_group.store, worker_group.group_rank))

        def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
            if self._pcontext is not None:
                kill_stopped_ranks_after_an_exit(self._pcontext.pids())
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.FAILED:
                decision = policy.decide(result.failures, self._remaining_restarts, worker_group.group_rank)
                on_decision(decision)
                self.restart_pending = decision.verdict is Verdict.RESTART
                if not self.restart_pending:
                    # torch's own agent turns restarts off the same way (a rank stuck in uninterruptible sleep).
                    self._remaining_restarts = 0
                worker_group.store.set(FAILURE_KEY, decision.failure.notice())
            return result

        def _stop_workers(self, worker_group: WorkerGroup, *args: object, **kwargs: object) -> None:
            restarting, self.restart_pending = self.restart_pending, False
            if restarting or policy.failed_elsewhere(worker_group.store, worker_group.group_rank):
                self._shutdown(signal.SIGKILL)
            else:
                super()._stop_workers(worker_group, *args, **kwargs)

    return RestartingAgent


@contextlib.contextmanager
def using_agent(agent_class: type[LocalElasticAgent]) -> Iterator[None]:
    """Have torch.distributed.run build `agent_class` while the block runs. Its launch_agent takes no agent class:
    it constructs LocalElasticAgent by the name in its own module (torch 2.13), so that name is rebound here and
    restored after; building the agent ourselves would mean copying launch_agent's rendezvous and shutdown."""
    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = agent_class
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original
