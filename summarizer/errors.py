"""The one exception type for mistakes a user can fix."""


class UserError(Exception):
    """A mistake the user can fix (a flag, a preset, a CSV); entry points print it as one `error: ...` line."""


class DiskFull(UserError):
    """A write that found no space left (or the quota used up): the user's to fix, and what was saved before is
    intact."""
