"""Prune the files of options that were not selected, and record where the bake came from.

Valid Python before rendering, idempotent (a file already gone is fine) and
confined to the project directory, so it also works under ``cruft update``: it writes
inside the project only, and reads the template's git state without writing to it
(``git rev-parse``, ``--no-optional-locks``: no index refresh).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

ANSWERS = json.loads(r"""{{ cookiecutter | tojson }}""")
PROJECT = Path.cwd()
PACKAGE = PROJECT / "src" / ANSWERS["package"]
#: Where the bake came from, read by its Makefile (make install, make infra-install).
SOURCE_FILE = PROJECT / "template-source.mk"
#: The lock files of every supported Python and runtime extras set (worker-template's
#: `make locks`, scripts/locks.py): the bake keeps its own pair.
LOCKS = PROJECT / "locks"
REMOTE = re.compile(r"^((git|hg)\+)?(git|ssh|file|https?)://|^\w+@[\w.]+|^(gh|gl|bb):")


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


def runtime_extras() -> list[str]:
    """worker-runtime's extras of the options (pyproject.toml pins the same)."""
    chosen = {"postgres": ANSWERS["database"] == "postgres",
              "sandbox": ANSWERS["sandbox_pool"] == "yes"}
    return [extra for extra, wanted in chosen.items() if wanted]


def keep_locks() -> None:
    """requirements.lock (the image's) and requirements-dev.lock (make install, CI): the
    pair of this bake's Python and extras; every other variant's files removed."""
    folder = LOCKS / ANSWERS["python_version"]
    stem = "-".join(["runtime", *runtime_extras()])
    for suffix, name in (("", "requirements.lock"), ("-dev", "requirements-dev.lock")):
        if (folder / f"{stem}{suffix}.lock").is_file():
            (folder / f"{stem}{suffix}.lock").replace(PROJECT / name)
    remove(LOCKS)


def template_dir(given: str) -> Path | None:
    """The template's local directory (cookiecutter's ``_repo_dir``), absolute. cookiecutter
    runs this hook from that directory (its ``work_in(repo_dir)``), so a relative one (``.``)
    is the parent process's working directory (Linux: /proc; elsewhere it is not recorded)."""
    if not given:
        return None
    path = Path(given)
    if not path.is_absolute():
        parent = Path(f"/proc/{os.getppid()}/cwd")
        path = parent.resolve() if parent.exists() else Path("/nonexistent")
    return path.resolve() if path.is_dir() else None


def git(directory: Path, *args: str) -> str:
    """A read-only git command's output in ``directory``, or '' (not a checkout, no git)."""
    try:
        done = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(directory), *args],
            capture_output=True, text=True, timeout=30, check=False,
        )
    except OSError:
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def is_remote(template: str) -> bool:
    """cookiecutter's own test: a URL, user@host, an abbreviation (gh:, gl:, bb:) or a zip
    file is cloned or unpacked into a directory that is not the team's."""
    return bool(REMOTE.match(template)) or template.endswith(".zip")


def record_source(template: str, repo_dir: str) -> None:
    """template-source.mk: the template as given to cookiecutter; when it was a local
    directory, that directory and the commit rendered (when it is a git checkout). cruft
    renders a clone of it (no ``_repo_dir``: the hook's parent runs in the clone), at the
    commit it creates or updates to: the directory recorded stays the one given, so `cruft
    update` moves the commit line only."""
    directory = None if is_remote(template) else template_dir(template)
    rendered = template_dir(repo_dir or ".")
    commit = git(rendered, "rev-parse", "--verify", "HEAD") if directory and rendered else ""
    lines = [
        "# Where this service was baked from (hooks/post_gen_project.py). make install and make",
        "# infra-install take worker-runtime and worker-infra from TEMPLATE_COMMIT of the",
        "# checkout TEMPLATE_DIR when it is on this machine; else from the pins.",
        f"TEMPLATE_SOURCE := {template}",
        f"TEMPLATE_DIR := {directory or ''}",
        f"TEMPLATE_COMMIT := {commit}",
    ]
    if rendered and commit and git(rendered, "status", "--porcelain", "--untracked-files=no"):
        lines.append("# The checkout had uncommitted changes: they are not in TEMPLATE_COMMIT.")
    SOURCE_FILE.write_text("\n".join(lines) + "\n")


def main() -> None:
    record_source(ANSWERS.get("_template", ""), ANSWERS.get("_repo_dir", ""))
    keep_locks()
    if ANSWERS["database"] != "postgres":
        remove_db_files()
    if ANSWERS["sandbox_pool"] != "yes":
        remove_sandbox_files()


if __name__ == "__main__":
    main()
