"""The error types every layer raises for what is not a bug.

:class:`ConfigError` means the user can fix it: its message names the key, its value and what is
valid, in one paragraph. ``run.py`` turns it into exit status 2 without a traceback.
:class:`InfrastructureError` is a machine fault (exit 3), :class:`NonFiniteSamplesError` a run whose
samples are not finite (exit 4).
"""


class ConfigError(ValueError):
    """A user error in the configuration: names the key, its value and what is valid."""


class InfrastructureError(RuntimeError):
    """The machine cannot do what the (valid) input asks: a missing command, an unusable directory.

    Its message is one paragraph naming the path or the command; ``run.py`` prints it and exits with
    status 3 (:mod:`specsamp.runner.exits`, which re-exports this class).
    """


class NonFiniteSamplesError(RuntimeError):
    """A run whose samples hold NaN or inf: not a result. ``run.py`` exits with status 4 and records it in
    ``failed.json`` (kind ``non_finite``) with :attr:`details` (how many, which trajectories, from which step).

    Attributes:
        details: JSON-ready ``{"samples", "of", "trajectories", "first_step", ...}``.
    """

    record_kind = "non_finite"

    def __init__(self, message: str, details: dict):
        super().__init__(message)
        self.details = details


def error_chain(error: BaseException | None, depth: int = 8):
    """``error``, then what it was raised from or during (``__cause__``, else ``__context__``), at most ``depth``."""
    for _ in range(depth):
        if error is None:
            return
        yield error
        error = error.__cause__ or error.__context__
