"""A Dockerfile's build stage run on this machine the way a builder runs it: its own RUN
commands, unchanged, in a folder standing for the image's filesystem (tests/test_packaging.py:
the bake's image installs in a venv with no network, as the Dockerfile says).

Enough of the syntax for the bake's Dockerfile: ARG (a default, or the value given as a
build argument), ENV, WORKDIR, COPY from the context (a glob that matches nothing is
skipped, as BuildKit does beside another source; a directory copies its contents) and RUN in
shell form; FROM starts a stage. Anything else in the stage run is refused.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FROM = re.compile(r"^FROM\s+\S+(?:\s+AS\s+(\S+))?$", re.IGNORECASE)


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str


def instructions(dockerfile: Path) -> list[Instruction]:
    """The instructions, continuation lines joined, comments dropped."""
    found: list[Instruction] = []
    pending = ""
    for line in dockerfile.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        keyword, _, arguments = whole.partition(" ")
        found.append(Instruction(keyword.upper(), arguments.strip()))
    return found


def stage(dockerfile: Path, name: str) -> list[Instruction]:
    """The instructions of stage ``name`` (its ``FROM ... AS name`` excluded), with the
    ARGs declared before the first FROM (their defaults) first."""
    steps = instructions(dockerfile)
    first = next(i for i, step in enumerate(steps) if step.keyword == "FROM")
    start = next(i for i, step in enumerate(steps)
                 if step.keyword == "FROM" and (m := FROM.match(f"FROM {step.arguments}"))
                 and m.group(1) == name)
    end = next((i for i in range(start + 1, len(steps)) if steps[i].keyword == "FROM"),
               len(steps))
    return steps[:first] + steps[start + 1:end]


def final_command(dockerfile: Path) -> list[str]:
    """The last stage's ENTRYPOINT and CMD (exec form)."""
    steps = {step.keyword: step.arguments for step in instructions(dockerfile)}
    return [*json.loads(steps["ENTRYPOINT"]), *json.loads(steps.get("CMD", "[]"))]


def copy(context: Path, sources: list[str], destination: Path) -> None:
    for source in sources:
        for match in sorted(context.glob(source)):
            if match.is_dir():
                shutil.copytree(match, destination, dirs_exist_ok=True)
            else:
                destination.mkdir(parents=True, exist_ok=True)
                shutil.copy2(match, destination / match.name)


def run_stage(steps: list[Instruction], context: Path, root: Path, env: dict[str, str],
              build_args: dict[str, str], wrap: Callable[..., list[str]]) -> None:
    """``steps`` run with ``root`` as the image's ``/``, COPY reading ``context``, each RUN
    as ``wrap("sh", "-c", command)`` in ``env`` plus the stage's ARGs and ENVs."""
    env = dict(env)
    workdir = root
    for step in steps:
        if step.keyword == "ARG":
            name, _, default = step.arguments.partition("=")
            env[name] = build_args.get(name, default)
        elif step.keyword == "ENV":
            for pair in shlex.split(step.arguments):
                name, _, value = pair.partition("=")
                env[name] = os.path.expandvars(value)
        elif step.keyword == "WORKDIR":
            workdir = root / step.arguments.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif step.keyword == "COPY":
            *sources, target = shlex.split(step.arguments)
            copy(context, sources, workdir / target)
        elif step.keyword == "RUN":
            done = subprocess.run(wrap("sh", "-c", step.arguments), cwd=workdir, env=env,
                                  capture_output=True, text=True, timeout=1200, check=False)
            assert done.returncode == 0, (step.arguments, done.stdout[-3000:],
                                          done.stderr[-3000:])
        else:
            raise AssertionError(f"{step.keyword} is not run here: {step.arguments}")
