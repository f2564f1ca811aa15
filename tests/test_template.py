"""Bake every supported combination of options, lint each result and run its own tests;
refuse bad answers with a message that names the answer and the rule; a bake holds what
the team owns (#40 item 3): a small ``src/`` with none of the runtime's machinery, and a
settings class whose own variables are validated like the runtime's."""

from __future__ import annotations

import ast
import itertools
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import worker_runtime
from bakery import (
    PYTHON,
    TEMPLATE,
    TEST_DATABASE_URL,
    copy_project,
    load_module,
    package_of,
    project_env,
    run_cli,
)

#: The defaults bake, tested without DATABASE_URL as a new team runs `make test` at first.
WITHOUT_DATABASE_URL = {"python_version": "3.12"}
OPTIONS = [
    {"database": database, "sandbox_pool": sandbox, "python_version": "3.11"}
    for database, sandbox in itertools.product(["postgres", "none"], ["yes", "no"])
] + [
    WITHOUT_DATABASE_URL,
    # the longest name the hooks allow: formatting must not depend on the name's length
    {"python_version": "3.13", "project": "a-very-long-project-name-for-lint-checks"},
]


def baked_files(project: Path) -> list[Path]:
    return [path for path in project.rglob("*") if path.is_file() and "__pycache__" not in path.parts]


def run(project: Path, *command: str, **env: str) -> subprocess.CompletedProcess[str]:
    inherited = {k: v for k, v in os.environ.items()
                 if k not in {"DATABASE_URL", "TEST_DATABASE_URL", "VIRTUAL_ENV"}}
    environment = {**inherited, "PYTHONPATH": str(project / "src"), **env}
    return subprocess.run(command, cwd=project, env=environment, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(o.values())[:40])
def test_bakes_lints_and_passes_its_own_tests(cookies, options: dict[str, str]) -> None:
    result = cookies.bake(extra_context={"project": "acme-worker", **options})
    project_package = options.get("project", "acme-worker").replace("-", "_")
    assert result.exit_code == 0, result.exception
    project = Path(result.project_path)

    leftovers = [
        str(path.relative_to(project)) for path in baked_files(project)
        if "{{ cookiecutter." in path.read_text(errors="ignore")
        or "{{cookiecutter." in path.read_text(errors="ignore")
    ]
    assert leftovers == []
    package = project / "src" / project_package
    assert (package / "db.py").exists() == (options.get("database", "postgres") == "postgres")
    assert (package / "sandbox.py").exists() == (options.get("sandbox_pool", "yes") == "yes")

    # As the baked README says: `make lint` and `make test` (this venv as their PYTHON). The
    # defaults bake (3.12) runs without DATABASE_URL: test_db.py skips, nothing else fails.
    database = {} if options == WITHOUT_DATABASE_URL else {"DATABASE_URL": TEST_DATABASE_URL}
    for target in ("lint", "test"):
        done = run(project, "make", target, f"PYTHON={PYTHON}",
                   PYTEST_ADDOPTS="-q -rs -p no:cacheprovider -p no:cloudcoil", **database)
        assert done.returncode == 0, f"make {target}\n{done.stdout[-4000:]}{done.stderr[-3000:]}"
    if not database:
        assert "SKIPPED" in done.stdout and "DATABASE_URL is not set" in done.stdout


BAD_ANSWERS = [
    ({"project": "Orders Worker"}, "project 'Orders Worker': must be a lowercase slug"),
    ({"project": "orders--worker"}, "must be a lowercase slug"),
    ({"project": "class"}, "package 'class': is a Python keyword"),
    ({"project": "json"}, "package 'json': shadows the standard-library module 'json'"),
    ({"project": "dramatiq"}, "package 'dramatiq': shadows the module 'dramatiq' of a dependency"),
    # transitive dependencies (of pydantic): derived from the baked pyproject, not listed
    ({"project": "typing-extensions"}, "package 'typing_extensions': shadows the module"),
    ({"project": "annotated-types"}, "package 'annotated_types': shadows the module"),
    ({"project": "python-dotenv"}, "project 'python-dotenv': is the name of a dependency"),
    ({"project": "yaml"}, "package 'yaml': shadows the module 'yaml' of a dependency"),
    # cookiecutter itself refuses a value outside a choice list
    ({"python_version": "3.9"}, "3.9 provided for choice variable python_version"),
    ({"database": "mysql"}, "mysql provided for choice variable database"),
    ({"k8s_namespace": "Prod_NS"}, "k8s_namespace 'Prod_NS': must be a DNS label"),
    ({"image": "registry.example.com/app:latest"}, "image 'registry.example.com/app:latest': has a tag (:latest)"),
    ({"image": "registry.example.com/foo:v1"}, "has a tag (:v1); give the repository only, e.g. registry.example.com/foo"),
    ({"image": "registry.example.com:5000/foo:v1"}, "has a tag (:v1)"),
    ({"image": "registry.example.com/foo@sha256:" + "a" * 64}, "image 'registry.example.com/foo@sha256:aaa"),
    ({"image": "Registry.example.com/Foo"}, "must be a lowercase image repository"),
    ({"template_repo": "not a url"}, "template_repo 'not a url': must be a git URL"),
    ({"owner": "team with spaces"}, "owner 'team with spaces': must be a Backstage entity reference"),
    ({"system": "team/a b"}, "system 'team/a b': must be a Backstage System name or reference"),
    ({"repo_url": "github.com/x"}, "repo_url 'github.com/x': must be an http(s) URL"),
    ({"grafana_url": "grafana"}, "grafana_url 'grafana': must be an http(s) URL"),
]


@pytest.mark.parametrize(("answers", "message"), BAD_ANSWERS, ids=[m for _, m in BAD_ANSWERS])
def test_refuses_bad_answers(cookies, capfd, answers: dict[str, str], message: str) -> None:
    result = cookies.bake(extra_context=answers)
    assert result.exit_code == -1
    assert message in capfd.readouterr().err + str(result.exception)
    assert result.project_path is None or not Path(result.project_path).exists()


def test_refusals_are_one_line(cookies, capfd) -> None:
    result = cookies.bake(extra_context={"project": "typing-extensions", "image": "r.io/x:1"})
    assert result.exit_code == -1
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("ERROR: ")]
    assert len(lines) == 2, lines
    assert "Traceback" not in "\n".join(lines)


@pytest.mark.parametrize(
    "answers",
    [{"image": "registry.example.com:5000/team/foo"}, {"image": "ghcr.io/acme/a_b.c--d"}],
    ids=lambda a: a["image"],
)
def test_accepts_image_repositories_with_a_port_or_path(cookies, answers: dict[str, str]) -> None:
    result = cookies.bake(extra_context=answers)
    assert result.exit_code == 0, result.exception
    main = (Path(result.project_path) / "infra" / "__main__.py").read_text()
    assert f'IMAGE = "{answers["image"]}"' in main


def _shadowed_names():  # type: ignore[no-untyped-def]
    return load_module("shadowed_names", TEMPLATE / "scripts" / "shadowed_names.py")


def test_the_hooks_dependency_names_are_current() -> None:
    """The hook's block is what the baked pyproject's dependencies (transitively) derive."""
    script = _shadowed_names()
    hook = (TEMPLATE / "hooks" / "pre_gen_project.py").read_text()
    assert script.current_block(hook) == script.block(), (
        "hooks/pre_gen_project.py is stale: run python scripts/shadowed_names.py --write"
    )
    _, modules = script.shadowed()
    assert {"dramatiq", "redis", "pydantic", "typing_extensions", "annotated_types",
            "psycopg", "pytest", "yaml"} <= set(modules)


def test_the_hook_checks_choices_against_cookiecutter_json() -> None:
    """For runners that skip cookiecutter's own check (replay, cruft): one line, same lists."""
    hook = (TEMPLATE / "hooks" / "pre_gen_project.py").read_text()
    context = json.loads((TEMPLATE / "cookiecutter.json").read_text())
    namespace: dict[str, object] = {"__name__": "hook"}
    rendered = hook.replace("{{ cookiecutter | tojson }}", "{}").replace(
        "{{ _cookiecutter | default({}) | tojson }}", json.dumps(context)
    )
    exec(compile(rendered, "pre_gen_project.py", "exec"), namespace)  # noqa: S102
    check = namespace["check_choices"]
    assert check({"python_version": "3.10"}) == (  # type: ignore[operator]
        "python_version '3.10': must be one of 3.11, 3.12, 3.13"
    )
    assert check({"python_version": "3.12", "database": "none"}) is None  # type: ignore[operator]


def test_bakes_without_a_prompt(tmp_path: Path) -> None:
    done = subprocess.run(
        [PYTHON, "-m", "cookiecutter", "--no-input", str(TEMPLATE), "-o", str(tmp_path),
         "project=foo-worker"], capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "foo-worker" / "src" / "foo_worker" / "__main__.py").is_file()


def test_hooks_are_idempotent(tmp_path: Path) -> None:
    """Running post-gen twice (as cruft update may) changes nothing the second time."""
    done = subprocess.run(
        [PYTHON, "-m", "cookiecutter", "--no-input", str(TEMPLATE), "-o", str(tmp_path),
         "project=idem-worker", "database=none", "sandbox_pool=no"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    project = tmp_path / "idem-worker"
    before = sorted(str(p) for p in baked_files(project))
    hook = (TEMPLATE / "hooks" / "post_gen_project.py").read_text()
    rendered = hook.replace(
        '{{ cookiecutter | tojson }}',
        '{"package": "idem_worker", "database": "none", "sandbox_pool": "no",'
        ' "python_version": "3.11"}',
    )
    for _ in range(2):
        subprocess.run([PYTHON, "-c", rendered], cwd=project, check=True)
    assert sorted(str(p) for p in baked_files(project)) == before


def test_hooks_are_valid_python_before_rendering() -> None:
    for hook in (TEMPLATE / "hooks").glob("*.py"):
        compile(hook.read_text(), str(hook), "exec")


def test_the_readmes_links_resolve_in_a_clone() -> None:
    """The template README points only at files of the repository (no ../shared/...)."""
    readme = (TEMPLATE / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)\)", readme) + re.findall(r"`(docs/[\w.-]+\.md)`", readme)
    assert "docs/design.md" in targets
    missing = [t for t in targets if "://" not in t and not (TEMPLATE / t).exists()]
    assert missing == [] and "shared/" not in readme, missing


# -- A bake holds what the team owns (#40 item 3) --------------------------------------------

#: The most lines of Python a default bake's src/ may hold (#40: "at most 1,500").
SRC_LINES = 1500
#: The bake's modules that may share a name with one of worker_runtime's: the thin entry
#: points a team keeps (its settings, its broker's middleware, its imports of the runtime's
#: db, sandbox, producer and lifecycle helpers). Any other shared name (supervisor,
#: consumer, settlement, layout...) is runtime code copied into the bake.
THIN = {"__init__", "__main__", "settings", "broker", "db", "sandbox", "producer", "lifecycle"}
#: Calls that load or run Lua on Redis: the runtime's (layout/) alone.
LUA_CALLS = {"register_script", "eval", "evalsha", "eval_ro", "evalsha_ro", "script_load"}
#: What every Redis Lua script holds (a string of it in the bake is a script).
LUA_MARKERS = ("redis.call(", "redis.pcall(")


def runtime_module_names() -> set[str]:
    root = Path(worker_runtime.__file__).parent
    return {path.stem for path in root.rglob("*.py")} | {
        path.name for path in root.rglob("*") if (path / "__init__.py").is_file()}


def machinery(path: Path, tree: ast.Module) -> list[str]:
    """What in one module of the bake is the platform's: Lua (a script's text, a call that
    loads or runs one), an import of dramatiq's internals (a submodule: the broker, the
    worker, the consumer and the middleware come from worker_runtime), a class deriving
    from a broker, consumer or worker."""
    found = []
    for node in ast.walk(tree):
        where = f"{path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and any(
                marker in node.value for marker in LUA_MARKERS):
            found.append(f"{where}: a Lua script")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                node.func.attr in LUA_CALLS):
            found.append(f"{where}: .{node.func.attr}() runs Lua")
        elif isinstance(node, ast.Import):
            found += [f"{where}: import {alias.name}" for alias in node.names
                      if alias.name.startswith("dramatiq.")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dramatiq."):
            found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.ClassDef):
            bases = [ast.unparse(base).rsplit(".", 1)[-1] for base in node.bases]
            found += [f"{where}: class {node.name}({base})" for base in bases
                      if base.endswith(("Broker", "Consumer", "Worker"))]
    return found


def test_a_default_bake_holds_the_teams_code_and_none_of_the_runtime(
        default_project: Path) -> None:
    """A default bake's src/ holds at most 1,500 lines of Python, in the service's package
    and its actors/ alone; no Lua (no .lua file in the bake, no script's text, no call that
    loads or runs one), no import of dramatiq's internals, no broker, consumer or worker
    class, no module named as one of worker_runtime's beyond the thin entry points."""
    src = default_project / "src"
    package = src / package_of(default_project)
    modules = sorted(src.rglob("*.py"))
    lines = sum(len(path.read_text().splitlines()) for path in modules)
    assert 0 < lines <= SRC_LINES, f"{lines} lines of Python under src/"
    assert {path.parent for path in modules} <= {package, package / "actors"}, modules
    assert sorted(default_project.rglob("*.lua")) == []
    shared = {path.stem for path in modules if path.parent == package} & runtime_module_names()
    assert shared <= THIN, f"runtime modules in the bake: {sorted(shared - THIN)}"
    found = [line for path in modules
             for line in machinery(path.relative_to(src), ast.parse(path.read_text()))]
    assert found == [], found


def test_the_machinery_check_finds_what_it_is_for() -> None:
    """The check above is not vacuous: each kind of runtime code it looks for is found."""
    planted = """
from dramatiq.brokers.redis import RedisBroker
import dramatiq.worker
FETCH = client.register_script("return redis.call('lpop', KEYS[1])")
class MyConsumer(dramatiq.Consumer): ...
"""
    found = machinery(Path("x.py"), ast.parse(planted))
    assert sorted(line.split(": ", 1)[1] for line in found) == [
        ".register_script() runs Lua", "a Lua script", "class MyConsumer(Consumer)",
        "from dramatiq.brokers.redis import ...", "import dramatiq.worker"], found
    assert {"supervisor", "consumer", "layout", "settlement"} <= runtime_module_names() - THIN


TEAM_SETTING = """
    partner_timeout_s: Annotated[float, Field(gt=0)] = 5.0
    \"\"\"How long a call to the partner may take (seconds).\"\"\"
"""


def test_a_bad_value_of_a_teams_own_variable_refuses_the_worker(
        default_project: Path, tmp_path: Path) -> None:
    """A variable the team adds to its bake's settings.Settings (the class the runtime loads
    as the service's) is read like the runtime's (`config` shows it) and a bad value makes
    the real `worker` command refuse to boot: exit 78, one line naming the variable."""
    project = copy_project(default_project, tmp_path / default_project.name)
    settings = project / "src" / package_of(project) / "settings.py"
    imported = "from worker_runtime.settings import WorkerSettings\n"
    assert imported in settings.read_text()
    settings.write_text(settings.read_text().replace(
        imported, f"from typing import Annotated\n\nfrom pydantic import Field\n{imported}"
    ) + TEAM_SETTING)
    env = project_env(project, WORKER_POOL="interactive", PARTNER_TIMEOUT_S="2.5",
                      WORKER_STATE_DIR=str(tmp_path / "state"))
    done = run_cli(project, "config", env=env)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^PARTNER_TIMEOUT_S +2\.5 +environment$", done.stdout, re.MULTILINE), (
        done.stdout)
    for value, rule in (("-1", "greater than 0"), ("soon", "a valid number")):
        env["PARTNER_TIMEOUT_S"] = value
        done = run_cli(project, "worker", env=env)
        assert done.returncode == 78, done.stdout[-2000:] + done.stderr[-2000:]
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"config error: PARTNER_TIMEOUT_S='{value}': "), lines
        assert rule in lines[0], lines
