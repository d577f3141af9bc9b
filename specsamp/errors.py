"""The one user-error type every layer raises.

:class:`ConfigError` means the user can fix it: its message names the key, its value and what is
valid, in one paragraph. ``run.py`` turns it into exit status 2 without a traceback.
"""


class ConfigError(ValueError):
    """A user error in the configuration: names the key, its value and what is valid."""


class InfrastructureError(RuntimeError):
    """The machine cannot do what the (valid) input asks: a missing command, an unusable directory.

    Its message is one paragraph naming the path or the command; ``run.py`` prints it and exits with
    status 3 (:mod:`specsamp.runner.exits`, which re-exports this class).
    """
