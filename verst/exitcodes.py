"""Exit codes of the `verst` command.

Every failure the user can act on ends with one line on stderr and one of these codes; anything
else is a crash (a traceback and code 1, or death by a signal). `verst train --max-restarts`
restarts a crashed trainer, never one that ended with `FINAL`: a restart cannot fix a bad
config, a full disk stays full, and a resume replays the same steps to the same non-finite loss.
"""

from __future__ import annotations

CRASH = 1  # Python's own code for an uncaught exception
BAD_INPUT = 2  # config, missing files, malformed data, a refused checkpoint
RUN_DIR = 3  # the run directory cannot be written (full disk, quota, permissions, read-only)
NON_FINITE = 4  # a NaN or infinite loss stopped the run at its last good checkpoint

FINAL = frozenset({BAD_INPUT, RUN_DIR, NON_FINITE})
