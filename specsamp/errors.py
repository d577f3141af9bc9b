"""The one user-error type every layer raises.

:class:`ConfigError` means the user can fix it: its message names the key, its value and what is
valid, in one paragraph. ``run.py`` turns it into exit status 2 without a traceback.
"""


class ConfigError(ValueError):
    """A user error in the configuration: names the key, its value and what is valid."""
