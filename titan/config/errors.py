"""The errors that end a run with a message of their own: user mistakes (ConfigError) and their common base."""

EXIT_USER_MISTAKE = 2
EXIT_DIVERGED = 3
EXIT_STOPPED_EARLY = 4
"""A preemption signal or --job.time_limit stopped the run at a step boundary; rerunning the command resumes."""
EXIT_HUNG = 5
"""A step outlasted --comm.train_timeout_seconds; each rank's stack is in <dump_folder>/hang/."""
KNOWN_EXIT_CODES = (EXIT_USER_MISTAKE, EXIT_DIVERGED, EXIT_STOPPED_EARLY, EXIT_HUNG)
"""Exit codes whose rank printed why it stopped (README "Troubleshooting")."""


class KnownStop(Exception):
    """An ending that explains itself: titan.exits prints the message without a traceback and the process exits
    with `exit_code`. `every_rank_stops`: every rank raises it at the same point (so ranks may meet once more)."""

    exit_code: int
    every_rank_stops = False


class ConfigError(KnownStop):
    """A mistake the user can fix by changing the config or the files it points at.

    Holds one line per problem; each line names the field, the value given and what to do. Exits with code 2.
    """

    exit_code = EXIT_USER_MISTAKE

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        if len(self.problems) == 1:
            return f"Config error: {self.problems[0]}"
        lines = "\n".join(f"  - {p}" for p in self.problems)
        return f"Config error ({len(self.problems)} problems):\n{lines}"
