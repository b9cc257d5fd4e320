"""The two errors a user can cause; the command line prints their message as one `error:` line, exit code 2."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration a user wrote is wrong; the message names the key and the fix."""


class StageInputError(RuntimeError):
    """Bad input a user can fix (empty split, unreadable file, missing column): one clear message."""
