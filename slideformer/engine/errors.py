"""User-facing errors: one message that names what, where and how to fix."""
from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input, reported without a traceback.

    Args:
        where: the file, flag or setting at fault.
        problem: what is wrong with it.
        fix: what the user can do about it.
    """

    def __init__(self, where: str, problem: str, fix: str):
        self.where, self.problem, self.fix = str(where), problem, fix
        super().__init__(f"{self.where}: {problem}\n  fix: {fix}")


def path_error(e: OSError) -> UserError:
    """The :class:`UserError` of an ``OSError`` about a path (``e.filename``)."""
    return UserError(e.filename, f"cannot be used: {e.strerror or e}",
                     "check that the path is a folder (or file) you can write to and that no "
                     "file stands where a folder should be")
