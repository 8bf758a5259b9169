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

The files, in the order a launch uses them:
    __main__.py     the launch: check, print or dry-run the job, or run its ranks and report how they ended
    cli.py          the checks of torchrun's flags and the launcher's environment (NGPU, LOG_RANK, MAX_RESTARTS)
    signals.py      passing stop signals on to the ranks
    agent.py        torchrun's agent with Titan's restarts, and how torchrun is made to build it
    restarts.py     RestartPolicy: which failed attempts restart, returned as a RestartDecision
    goodput_log.py  what the launcher reads from and writes to the job's goodput log
    procs.py        the ranks' processes as /proc shows them
"""

from titan.launch.cli import read_max_restarts
from titan.launch.procs import child_pids

__all__ = ["child_pids", "read_max_restarts"]
"""What code outside the launcher uses (the tests' job harness and its checks of MAX_RESTARTS)."""
