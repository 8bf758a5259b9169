"""The error for a user mistake: a config, or a file it points at, that Titan cannot run with."""

EXIT_USER_MISTAKE = 2


class ConfigError(Exception):
    """A mistake the user can fix by changing the config or the files it points at.

    Holds one line per problem; each line names the field, the value given and what to do. titan.exits prints it
    without a traceback and the process exits with code 2. The runtime stops (a diverged loss, a preemption) are
    titan.exits.KnownStop; this one sits below them, with the config that raises it first.
    """

    exit_code = EXIT_USER_MISTAKE
    every_rank_stops = False
    """A mistake may be seen by one rank alone (a file only its node lacks), so ranks must not wait for each other."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        if len(self.problems) == 1:
            return f"Config error: {self.problems[0]}"
        lines = "\n".join(f"  - {p}" for p in self.problems)
        return f"Config error ({len(self.problems)} problems):\n{lines}"
