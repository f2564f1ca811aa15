"""The lock files every bake carries: for each supported Python (cookiecutter.json's
``python_version``) and each set of worker-runtime's extras the options choose (database,
sandbox_pool), ``<python>/runtime[-extra...].lock`` (the image's: the Dockerfile installs it
with ``--require-hashes``) and ``...-dev.lock`` (make install and the bake's CI), under
``{{cookiecutter.project}}/locks/``; the post-gen hook keeps the bake's pair as
requirements.lock and requirements-dev.lock and removes the rest.

Each pins every dependency with its hashes, at the versions the template's CI tests: the
bake's own `make lock` (uv's pip compile, universal from that Python) with
requirements-dev.txt's pins as constraints.
worker-runtime itself is left out: the image installs it from a wheel of the recorded commit
or from its pin, make install from the commit or the pin (the bake's Makefile).

    python scripts/locks.py          # rewrite them (`make locks`; needs the package index)
    python scripts/locks.py --check  # offline: fail when one is stale (tests/test_packaging.py)

Stale: a file missing or extra, a line without its pin or hashes, a dependency the bake
declares (worker-runtime's, its extras', the bake's dev tools, and what their installed
metadata requires, transitively) missing or outside its range, or a pin other than
requirements-dev.txt's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker, default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

TEMPLATE = Path(__file__).resolve().parents[1]
LOCKS = TEMPLATE / "{{cookiecutter.project}}" / "locks"
RUNTIME = TEMPLATE / "runtime"
CI_PINS = TEMPLATE / "requirements-dev.txt"
PIN = re.compile(r"^([A-Za-z0-9._-]+)==([^\s;\\]+)\s*(?:;\s*([^\\]+?))?\s*\\?$")


@dataclass(frozen=True)
class Variant:
    """One lock pair: a Python and the runtime's extras."""

    python: str
    extras: tuple[str, ...]

    @property
    def stem(self) -> str:
        return "-".join(("runtime", *self.extras))

    def path(self, dev: bool) -> Path:
        return LOCKS / self.python / f"{self.stem}{'-dev' if dev else ''}.lock"

    def answers(self) -> dict[str, str]:
        return {"python_version": self.python,
                "database": "postgres" if "postgres" in self.extras else "none",
                "sandbox_pool": "yes" if "sandbox" in self.extras else "no"}


def variants() -> list[Variant]:
    """Every Python of cookiecutter.json times every extras set of its options."""
    answers = json.loads((TEMPLATE / "cookiecutter.json").read_text())
    sets = [(), ("postgres",), ("sandbox",), ("postgres", "sandbox")]
    return [Variant(python, extras) for python in answers["python_version"] for extras in sets]


@dataclass(frozen=True)
class Pin:
    version: str
    marker: Marker | None
    hashes: int


def read_lock(path: Path) -> dict[str, list[Pin]]:
    """A lock file's pins per (canonical) name; a name may have several under markers."""
    pins: dict[str, list[Pin]] = {}
    current: list[Pin] | None = None
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if line.startswith(" ") and stripped.startswith("--hash=") and current:
            last = current[-1]
            current[-1] = Pin(last.version, last.marker, last.hashes + 1)
            continue
        match = PIN.match(stripped)
        if not match:
            raise ValueError(f"{path}: not a pin: {stripped!r}")
        name, version, marker = match.groups()
        current = pins.setdefault(canonicalize_name(name), [])
        current.append(Pin(version, Marker(marker) if marker else None, 0))
    return pins


def environment(python: str) -> dict[str, str]:
    """The markers' environment of the image: Linux, CPython ``python``."""
    env = {key: str(value) for key, value in default_environment().items()}
    env.update(python_version=python, python_full_version=f"{python}.0", sys_platform="linux",
               platform_system="Linux", os_name="posix", implementation_name="cpython",
               platform_python_implementation="CPython")
    return env


def applies(marker: Marker | None, env: dict[str, str], extra: str = "") -> bool:
    return marker is None or marker.evaluate({**env, "extra": extra})


def declared(variant: Variant, project: dict[str, object], dev: bool) -> list[Requirement]:
    """What the bake declares: worker-runtime's dependencies and its extras' (the bake pins
    worker-runtime[extras]), the bake's own others, its dev tools for the dev lock."""
    runtime = tomllib.loads((RUNTIME / "pyproject.toml").read_text())["project"]
    lines = list(runtime["dependencies"])
    for extra in variant.extras:
        lines += runtime["optional-dependencies"][extra]
    own = project.get("dependencies", [])
    assert isinstance(own, list)
    lines += [line for line in own if canonicalize_name(Requirement(line).name) != "worker-runtime"]
    if dev:
        optional = project.get("optional-dependencies", {})
        assert isinstance(optional, dict)
        lines += optional["dev"]
    return [Requirement(line) for line in lines]


def installed_requires(name: str, version: str) -> list[Requirement] | None:
    """The requirements of ``name`` from this venv's metadata when it has that version."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != version:
        return None
    return [Requirement(line) for line in dist.requires or []]


def ci_pins() -> dict[str, str]:
    """requirements-dev.txt's ``name==version`` lines: the versions the template's CI runs."""
    pins: dict[str, str] = {}
    for line in CI_PINS.read_text().splitlines():
        requirement = line.split("#")[0].strip()
        if "==" in requirement and not requirement.startswith("-"):
            parsed = Requirement(requirement)
            pins[canonicalize_name(parsed.name)] = str(parsed.specifier).removeprefix("==")
    return pins


def lock_problems(path: Path, variant: Variant, wanted: list[Requirement]) -> Iterator[str]:
    """Why ``path`` does not lock ``wanted`` (and what their metadata requires) for the
    variant's Python, each a line."""
    pins = read_lock(path)
    env = environment(variant.python)
    for name, entries in pins.items():
        if any(pin.hashes == 0 for pin in entries):
            yield f"{path.name}: {name} has no --hash"
    tested = ci_pins()
    queue = [(requirement, "the bake") for requirement in wanted]
    seen: set[tuple[str, str]] = set()
    while queue:
        requirement, via = queue.pop()
        name = canonicalize_name(requirement.name)
        for extra in sorted(requirement.extras) or [""]:
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            pin = next((p for p in pins.get(name, []) if applies(p.marker, env)), None)
            if pin is None:
                yield f"{path.name}: {name} (required by {via}) is not locked"
                continue
            if not requirement.specifier.contains(pin.version, prereleases=True):
                yield (f"{path.name}: {name}=={pin.version} is outside {requirement} "
                       f"(required by {via})")
            if name in tested and tested[name] != pin.version:
                yield (f"{path.name}: {name}=={pin.version}, but the template's CI runs "
                       f"{tested[name]} (requirements-dev.txt)")
            for child in installed_requires(name, pin.version) or []:
                if applies(child.marker, env, extra):
                    queue.append((child, f"{name}=={pin.version}"))


def check() -> list[str]:
    """Every stale lock file, a line each (no network, no write)."""
    expected = {v.path(dev) for v in variants() for dev in (False, True)}
    present = set(LOCKS.rglob("*.lock")) if LOCKS.is_dir() else set()
    problems = [f"{p.relative_to(TEMPLATE)}: missing" for p in sorted(expected - present)]
    problems += [f"{p.relative_to(TEMPLATE)}: no variant writes it" for p in
                 sorted(present - expected)]
    with tempfile.TemporaryDirectory() as scratch:
        for variant in variants():
            project = tomllib.loads((bake(variant, Path(scratch)) / "pyproject.toml").read_text())
            for dev in (False, True):
                if variant.path(dev).exists():
                    wanted = declared(variant, project["project"], dev)
                    problems += lock_problems(variant.path(dev), variant, wanted)
    return problems


def bake(variant: Variant, output: Path) -> Path:
    """A bake of the variant's answers (its pyproject.toml is what the lock resolves)."""
    from cookiecutter.main import cookiecutter  # type: ignore[import-untyped]

    return Path(cookiecutter(str(TEMPLATE), no_input=True, overwrite_if_exists=True,
                             output_dir=str(output / variant.python / variant.stem),
                             extra_context=variant.answers()))


def compile_locks(project: Path, variant: Variant, constraints: Path) -> int:
    """The bake's own `make lock` (worker-runtime from this checkout, left out), constrained
    to the CI's pins; its two files moved to the variant's paths."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIRTUAL_ENV", "PYTHON", "MAKE", "MFLAGS"))}
    done = subprocess.run(["make", "-s", "lock", f"PYTHON={sys.executable}",
                           f"WORKER_TEMPLATE={TEMPLATE}",
                           f"LOCK_CONSTRAINTS=--constraint {constraints}"],
                          cwd=project, env=env, check=False)
    if done.returncode == 0:
        for dev, name in ((False, "requirements.lock"), (True, "requirements-dev.lock")):
            variant.path(dev).parent.mkdir(parents=True, exist_ok=True)
            (project / name).replace(variant.path(dev))
    return done.returncode


def write() -> int:
    """Every variant's pair rewritten, the others removed."""
    with tempfile.TemporaryDirectory() as scratch:
        constraints = Path(scratch) / "ci-pins.txt"
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(ci_pins().items())))
        for stale in LOCKS.rglob("*.lock") if LOCKS.is_dir() else []:
            stale.unlink()
        for variant in variants():
            if code := compile_locks(bake(variant, Path(scratch)), variant, constraints):
                return code
    print(f"locks: {len(list(LOCKS.rglob('*.lock')))} files in {LOCKS.relative_to(TEMPLATE)}")
    return 0


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        problems = check()
        for problem in problems:
            print(f"stale lock: {problem}", file=sys.stderr)
        if problems:
            print("run `make locks` at worker-template's root and commit the files",
                  file=sys.stderr)
        return 1 if problems else 0
    if argv:
        print("usage: locks.py [--check]", file=sys.stderr)
        return 2
    return write()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
