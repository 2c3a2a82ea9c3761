"""The exceptions the CLI turns into exit codes: a UserError (2) and a diverged run (3), each as one line."""


class UserError(Exception):
    """A problem in the user's input (config, paths, data, devices) whose message says what to do."""


class Stalled(UserError):
    """A rank did not reach a collective within ddp_timeout; the message names it and the iteration."""


class RanksFailed(Exception):
    """torchrun, started for several devices, ended with an error; its ranks' output says which and why."""

    def __init__(self, exit_code: int):
        super().__init__(f"torchrun exited with code {exit_code}; the ranks' output above says why")
        self.exit_code = exit_code


class Diverged(Exception):
    """Training stopped after nan_patience non-finite windows in a row; last.pt holds the last good state."""

    exit_code = 3  # distinct from usage errors (2) and signals (130, 143), so scripts can retry with other settings
