"""The exceptions for mistakes a user can fix: UserError (config.py's, where the first of them, a setting, is
caught; every module takes it from here) and DiskFull."""
from config import UserError

__all__ = ["UserError", "DiskFull"]


class DiskFull(UserError):
    """A write that found no space left (or the quota used up): the user's to fix, and what was saved before is
    intact."""
