"""The one exception type for mistakes a user can fix; the CLI turns it into exit code 2 and one line."""


class UserError(Exception):
    """A problem in the user's input (config, paths, data, devices) whose message says what to do."""
