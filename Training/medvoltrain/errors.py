"""Errors of the training package: subclasses of medvolcore's one exception family.

The ``medvol-train`` command line prints ``str(error)`` as one line and exits non-zero.
"""

from __future__ import annotations

from medvolcore.errors import InputError, MedVolError


class ConfigError(InputError):
    """A training configuration is wrong: unknown key, bad value, unreadable YAML."""

    code = "bad_config"


class DataError(MedVolError):
    """A training data folder or manifest is missing, malformed or empty."""

    code = "bad_data"


class CaseError(MedVolError):
    """One case (manifest row) cannot be prepared; ``reason`` is its category in the summary."""

    code = "bad_case"

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


__all__ = ["ConfigError", "DataError", "CaseError"]
