"""The error types that several modules raise or catch, at the bottom of the package: this module imports nothing
of the project, so any module may import its errors without pulling in what raises them.

Every error a user can fix derives from UserError: its message is one line saying what is wrong and how to fix
it, and the scripts' one CLI wrapper (gptkit/cli.py's entry_point) prints it as `error: ...` and exits 1. An
error only one module raises may stay in that module, derived from one of these.
"""


class UserError(Exception):
    """A problem the user can fix: the message is one line saying what is wrong and how to fix it.
    `every_rank`: every process of a torchrun job meets it alike (a bad setting), so one process per machine
    says it (entry_point)."""

    every_rank = False


class UsageError(UserError):
    """A bad command line."""

    every_rank = True


class ConfigError(UserError):
    """A bad config file, key or value; the message says which and how to fix it."""

    every_rank = True  # the same files and command line in every process of a torchrun job


class DataError(UserError):
    """A problem with the user's data or arguments. The message is one line saying what is wrong and how to fix it."""


class DPOError(UserError):
    """Bad DPO settings, or a reference that cannot be what the settings ask."""


class LoRAError(UserError):
    """Bad LoRA settings, or adapters that do not fit their base."""
