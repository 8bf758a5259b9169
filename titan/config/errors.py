"""The one exception for user mistakes: bad config values, bad paths, bad input data."""


class ConfigError(Exception):
    """A mistake the user can fix by changing the config or the files it points at.

    Holds one line per problem; each line names the field, the value given and what to do.
    train.py prints the message without a traceback and exits with `exit_code`.
    """

    exit_code = 2

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        if len(self.problems) == 1:
            return f"Config error: {self.problems[0]}"
        lines = "\n".join(f"  - {p}" for p in self.problems)
        return f"Config error ({len(self.problems)} problems):\n{lines}"
