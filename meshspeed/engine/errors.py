"""Errors of the training loop's own rules (no_sync, unused parameters), as types that
DeepSpeed's callers catch.

Note [DeepSpeed's exception types]
DeepSpeed guards these rules with `assert`, so scripts and DeepSpeed's own tests catch
AssertionError (and match a phrase of its message). Each class here is a RuntimeError,
as meshspeed's loop errors are, and also an AssertionError. The message leads with the
phrase DeepSpeed's callers match: pytest prints an exception's repr cut to 240
characters, so a phrase at the end of a long message would be cut out of `str(excinfo)`.
"""

from __future__ import annotations


class NoSyncError(RuntimeError, AssertionError):
    """`engine.no_sync()` where gradients are sharded, nested, or `step()` inside it."""


class UnusedParametersError(RuntimeError, AssertionError):
    """Trainable parameters got no gradient in an accumulation window while the config
    says not to ignore them (`zero_optimization.ignore_unused_parameters: false`)."""
