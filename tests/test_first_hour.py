"""The first hour of a product team with a fresh bake, beyond the README's runbook
(test_readme_runbook.py): `make` alone helps, infra/ installs from the pinned tag or a
local checkout of this template and says which, and what cannot run says in one line
what to run instead."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from bakery import TEMPLATE, bake_project


def make(project: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``make *args`` in ``project`` as a new team runs it: no venv active, no PYTHON."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIRTUAL_ENV", "PYTHON", "MAKE", "MFLAGS"))}
    return subprocess.run(["make", *args], cwd=project, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bake_project(tmp_path_factory.mktemp("first-hour"))


def test_a_bare_make_prints_help_and_installs_nothing(project: Path) -> None:
    done = make(project)
    assert done.returncode == 0, done.stderr
    targets = [line.split()[0] for line in done.stdout.splitlines()[1:]]
    assert {"help", "install", "run", "test", "lint", "infra-install",
            "manifests", "docs"} <= set(targets), done.stdout
    assert all(len(line.split(maxsplit=1)) == 2 for line in done.stdout.splitlines()[1:])
    assert not (project / ".venv").exists()
    assert make(project, "help").stdout == done.stdout


@pytest.mark.parametrize("target", ["manifests", "simulate", "alerts", "alerts-check"])
def test_infra_targets_without_worker_infra_say_what_to_run(project: Path, target: str) -> None:
    """Without infra/venv (and with a python that lacks worker_infra): one line, no
    ModuleNotFoundError traceback."""
    done = make(project, target, "STACK=dev", "PYTHON=python3")
    assert done.returncode != 0
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert "worker-infra is not installed: run 'make infra-install'" in lines[0]
    assert "WORKER_TEMPLATE=" in lines[0]


def test_an_unreachable_pin_says_to_use_a_local_checkout(tmp_path: Path) -> None:
    """The pinned tag's repository is not reachable (a fresh bake's placeholder org is
    not): pip's error, then the one line naming the pin and the local-checkout command."""
    project = bake_project(tmp_path, template_repo=f"file://{tmp_path}/no-such-repo")
    done = make(project, "infra-install", timeout=600)
    assert done.returncode != 0
    assert done.stdout.startswith(
        f"worker-infra: from the pinned tag git+file://{tmp_path}/no-such-repo@v0.1.0"
    ), done.stdout
    last = done.stdout.strip().splitlines()[-1]
    assert last == (
        f"infra-install: could not install git+file://{tmp_path}/no-such-repo@v0.1.0"
        "#subdirectory=infra; from a local checkout of worker-template: "
        "make infra-install WORKER_TEMPLATE=/path/to/worker-template"
    ), done.stdout


def test_a_wrong_local_checkout_is_one_line(project: Path, tmp_path: Path) -> None:
    done = make(project, "infra-install", f"WORKER_TEMPLATE={tmp_path}")
    assert done.returncode != 0
    assert f"infra-install: {tmp_path} is not a checkout of worker-template" in done.stdout
    assert not (project / "infra" / "venv").exists()


@pytest.mark.slow
def test_infra_install_from_a_local_checkout_renders_dev(tmp_path: Path) -> None:
    """`make infra-install WORKER_TEMPLATE=<this checkout>` then `make manifests STACK=dev`
    in a fresh bake whose pin points nowhere reachable: worker-infra comes from the checkout
    (editable), the rest of infra/requirements.txt from PyPI, and it says so."""
    project = bake_project(tmp_path, template_repo="https://github.com/example-org/worker-template")
    python = shutil.which("python3")
    assert python
    done = make(project, "infra-install", f"WORKER_TEMPLATE={TEMPLATE}", timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.startswith(
        f"worker-infra: from the local checkout {TEMPLATE}/infra (WORKER_TEMPLATE), not the pin "
        "git+https://github.com/example-org/worker-template@v0.1.0#subdirectory=infra"
    ), done.stdout
    where = subprocess.run(
        [str(project / "infra" / "venv" / "bin" / "python"), "-c",
         "import worker_infra; print(worker_infra.__file__)"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert where.stdout.strip().startswith(str(TEMPLATE / "infra")), where.stdout
    done = make(project, "manifests", "STACK=dev", timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    objects = [o for o in yaml.safe_load_all((project / "build/manifests/dev.yaml").read_text())
               if o]
    assert sum(o["kind"] == "Deployment" for o in objects) >= 5
