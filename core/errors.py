"""The one error type for bad input a user can fix.

A CLI (``core.overrides.run_cli``) prints a :class:`UserError` as one line and exits 2; any other exception is a
bug and shows its traceback. It subclasses ValueError, so code that catches ValueError still catches it.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input (an option, a file, a model, a dataset); the message is one line naming the problem and the fix."""
