"""The exceptions for mistakes a user can fix: UserError (command_line.py's, the lowest module, since a command
line is the first thing a user can get wrong; every module takes it from here) and DiskFull."""
from command_line import UserError

__all__ = ["UserError", "DiskFull"]


class DiskFull(UserError):
    """A write that found no space left (or the quota used up): the user's to fix; what was saved is intact."""
