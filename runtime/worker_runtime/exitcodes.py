"""Exit codes: the one table every command and process of the service returns.

Like Dramatiq's ``RET_*`` constants, and the same values as BSD ``sysexits.h``
where one exists. The README shows this table; tests and probes rely on it.
"""

from __future__ import annotations

from typing import Final

#: Done: the command did what was asked; a worker process drained and stopped cleanly.
EX_OK: Final = 0
#: Failure: an unknown id, Redis or the database unreachable, a probe that says "not
#: live" or "not ready", a worker process that lost work.
EX_FAILURE: Final = 1
#: Usage: bad arguments (argparse's own code), or a destructive command without ``--yes``.
EX_USAGE: Final = 2
#: Internal software error (sysexits ``EX_SOFTWARE``): the sandbox child could not set up
#: its confinement. ``sandbox/_child.py`` runs with the standard library only, so it
#: repeats the value as ``SETUP_FAILED``; a test checks that the two agree.
EX_SOFTWARE: Final = 70
#: A worker process asks its supervisor to replace it (sysexits ``EX_TEMPFAIL``): a handler
#: would not stop after its time limit; the process drained the rest, charged that job as a
#: time limit and left its thread behind (:mod:`.overrun`). The supervisor starts another at
#: once; it never exits with this code itself.
EX_REPLACE: Final = 75
#: Bad configuration (sysexits ``EX_CONFIG``): a bad variable or pools.toml, an actor on
#: a queue no pool serves, an actor module that does not import, a busy ``METRICS_PORT``.
#: One line per problem on stderr, no traceback. The supervisor exits with it too when a
#: worker process exits with it (a restart would fail the same way). The sandbox pool's
#: workers exit with it where the sandbox cannot run (``sandbox.SandboxUnavailableError``); the
#: sandbox child, standard library only, repeats it as ``UNCONTAINED`` (a test checks).
EX_CONFIG: Final = 78
#: Interrupted by Ctrl-C (128 + SIGINT, the shell's convention), e.g. ``capacity``.
EX_INTERRUPTED: Final = 130
