"""build/wheelhouse: every distribution a bake of this checkout installs, for this Python.

A bake made from this checkout installs worker-runtime and worker-infra from the commit it
was baked from (its template-source.mk), and their dependencies, its dev tools, the Pulumi
program's requirements and the build backend (setuptools) from this folder with pip's
``--no-index`` when it exists: `make install`, `make wheel` and `make infra-install` then
need no network. The pins of every lock file a bake carries (scripts/locks.py) are here, so
make install and the image's install (the Dockerfile's) take exactly those.
This script is the one step that does (``pip download``, from the package index or
PIP_INDEX_URL); `make wheelhouse` runs it. Wheels for this interpreter only: a bake whose
venv runs another Python falls back to the package index.

The folder is filled apart and renamed into place: DEST, when it exists, is always a
complete fill (a bake's Makefile uses it whenever it is there), never one under way. Fills
take turns (a lock beside DEST: two xdist workers, two makes); a fill starts from the
files already there (hard links), so pip downloads only what is new.

    python scripts/wheelhouse.py [DEST]
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cookiecutter.main import cookiecutter  # type: ignore[import-untyped]
from locks import LOCKS, applies, read_lock
from packaging.markers import default_environment

TEMPLATE = Path(__file__).resolve().parents[1]
DEST = TEMPLATE / "build" / "wheelhouse"


def bake(output: Path) -> Path:
    """The bake with every option (the superset of the dependencies)."""
    return Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(output),
                             extra_context={"database": "postgres", "sandbox_pool": "yes"}))


def infra_requirements(project: Path, output: Path) -> Path:
    """infra/requirements.txt without its two git pins (their source is the commit)."""
    lines = (project / "infra" / "requirements.txt").read_text().splitlines()
    path = output / "infra-requirements.txt"
    path.write_text("\n".join(line for line in lines if " @ " not in line) + "\n")
    return path


def locked(output: Path) -> list[Path]:
    """Every pin of the lock files that applies to this interpreter, in requirement files
    holding one version of each name (a name the variants pin at two versions: two files)."""
    env = {key: str(value) for key, value in default_environment().items()}
    rounds: list[dict[str, str]] = []
    for lock in sorted(LOCKS.rglob("*.lock")):
        for name, pins in read_lock(lock).items():
            for pin in pins:
                if not applies(pin.marker, env):
                    continue
                line = f"{name}=={pin.version}"
                if any(taken.get(name) == line for taken in rounds):
                    continue
                free = next((taken for taken in rounds if name not in taken), None)
                if free is None:
                    rounds.append(free := {})
                free[name] = line
    paths = []
    for index, taken in enumerate(rounds):
        paths.append(output / f"locked-{index}.txt")
        paths[-1].write_text("".join(f"{line}\n" for line in taken.values()))
    return paths


def download(dest: Path, *requirements: str) -> int:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest)]
    return subprocess.run([*command, *requirements], check=False).returncode


def fill(dest: Path) -> int:
    """The service's set and infra/venv's set apart, as each is installed (and locked: `make
    lock` resolves the service alone), so neither's versions are held back by the other's."""
    runtime = f"{TEMPLATE / 'runtime'}[postgres,sandbox]"
    with tempfile.TemporaryDirectory() as scratch:
        project = bake(Path(scratch))
        code = download(dest, "pip", "setuptools>=69", runtime, f"{project}[dev]") or download(
            dest, runtime, str(TEMPLATE / "infra"), "-r",
            str(infra_requirements(project, Path(scratch))))
        for pins in locked(Path(scratch)):
            code = code or download(dest, "--no-deps", "-r", str(pins))
    return code


RENAME_EXCHANGE = 2  # renameat2(2)'s flag
AT_FDCWD = -100


def exchange(one: Path, other: Path) -> bool:
    """Swap two folders in one step (Linux's renameat2); False where it is not supported."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(AT_FDCWD, os.fsencode(one), AT_FDCWD, os.fsencode(other),
                 RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
        return False
    raise OSError(code, os.strerror(code), str(one), None, str(other))


def publish(filled: Path, dest: Path) -> None:
    """``filled`` becomes ``dest`` by a rename; the old ``dest`` (a subset of ``filled``: the
    fill started from its files) ends at ``filled``'s path, for the caller to remove."""
    if not dest.exists():
        filled.rename(dest)
    elif not exchange(filled, dest):
        old = filled.with_name(filled.name + "-old")
        dest.rename(old)  # (no renameat2 here: dest is missing for the two renames' gap)
        filled.rename(dest)
        old.rename(filled)


def main(dest: Path = DEST) -> int:
    """Fill ``dest`` apart, then rename it into place (see the module's docstring)."""
    dest = dest.resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with (dest.parent / f".{dest.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with tempfile.TemporaryDirectory(prefix=f".{dest.name}-", dir=dest.parent) as work:
            filling = Path(work) / dest.name
            filling.mkdir()
            for old in dest.iterdir() if dest.is_dir() else ():
                try:
                    os.link(old, filling / old.name)
                except OSError:
                    shutil.copy2(old, filling / old.name)
            code = fill(filling)
            if code == 0:
                publish(filling, dest)
    if code == 0:
        print(f"wheelhouse: {len(list(dest.iterdir()))} files in {dest}")
    return code

if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEST))
