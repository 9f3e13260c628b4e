"""The exception for a mistake in what the user asked for; :mod:`hpcllm.errors` reports it.

It sits at the bottom of the package, below launcher detection, so that the first check a job
meets (how it was launched) raises the same exception as every later one.
"""

from __future__ import annotations

USER_ERROR_EXIT = 2


class UserError(Exception):
    """A mistake in what the user asked for (config, sizes, paths), reported without a traceback.

    ``same_on_all_ranks`` says whether every rank detects the error from the same inputs (a bad
    grid size, say). Then only rank 0 prints it, so an 8-rank job shows one line, not eight,
    and every rank exits on its own with no collective left waiting. An error that only some
    ranks see (a file missing on one node) is printed with its rank and aborts the whole MPI
    job, since the other ranks may already wait in a collective.
    """

    def __init__(self, message: str, *, same_on_all_ranks: bool = True) -> None:
        super().__init__(message)
        self.same_on_all_ranks = same_on_all_ranks
