"""Prune the files of options that were not selected.

Valid Python before rendering, idempotent (a file already gone is fine) and
confined to the project directory, so it also works under ``cruft update``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ANSWERS = json.loads(r"""{{ cookiecutter | tojson }}""")
PROJECT = Path.cwd()
PACKAGE = PROJECT / "src" / ANSWERS["package"]


def remove(*paths: Path) -> None:
    """Remove files or directories inside the project; missing ones are fine."""
    for path in paths:
        if PROJECT not in path.resolve().parents:
            raise RuntimeError(f"refusing to remove {path}: outside the project")
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def remove_db_files() -> None:
    """The database option's own file: the handlers' door to the runtime's pool (the runtime's
    ``postgres`` extra is chosen in pyproject.toml)."""
    remove(PACKAGE / "db.py", PROJECT / "tests" / "test_db.py")


def remove_sandbox_files() -> None:
    """The sandbox pool's actor and the handlers' door to the runtime's sandbox."""
    remove(PACKAGE / "sandbox.py", PACKAGE / "actors" / "sandbox.py")


def main() -> None:
    if ANSWERS["database"] != "postgres":
        remove_db_files()
    if ANSWERS["sandbox_pool"] != "yes":
        remove_sandbox_files()


if __name__ == "__main__":
    main()
