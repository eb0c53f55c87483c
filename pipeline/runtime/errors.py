"""The user's mistakes: the one error type every layer raises and the command turns into a message."""


class UserError(ValueError):
    """A mistake in the user's config or data, not in the code: its message says
    what is wrong, the value, the config key or file, and the fix. The command
    prints it without a traceback and exits with code 2 (docs/configuration.md)."""
