"""The template's packaging (#40 items 4 and 5): one version for worker-runtime and
worker-infra, a bake that records where it came from, and a fresh bake of a local checkout
that installs, tests and renders with no network and no variable to set."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from bakery import TEMPLATE, bake_project, make, project_env

CHANGELOG_HEADING = re.compile(r"^## (\d+\.\d+\.\d+)", re.MULTILINE)


def git(directory: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True,
                          timeout=60, check=True).stdout.strip()


def recorded(project: Path) -> dict[str, str]:
    """template-source.mk's variables."""
    lines = (project / "template-source.mk").read_text().splitlines()
    return dict(line.split(" := ", 1) for line in lines if " := " in line)


def cookiecutter_in(cwd: Path, template: str, output: Path,
                    env: dict[str, str] | None = None) -> Path:
    """A bake by cookiecutter run in ``cwd`` (its own process: the hook reads the caller's
    directory) of ``template`` as a team gives it (``.``, a URL)."""
    script = ("import sys; from cookiecutter.main import cookiecutter; "
              "print(cookiecutter(sys.argv[1], no_input=True, output_dir=sys.argv[2]))")
    return Path(subprocess.run([sys.executable, "-c", script, template, str(output)], cwd=cwd,
                               env=env, capture_output=True, text=True, timeout=300,
                               check=True).stdout.strip())


def test_the_runtime_and_infra_carry_the_one_version() -> None:
    """runtime/pyproject.toml's version is the source; infra's version and its dependency on
    the runtime, the bake's pins, cookiecutter.json's and the Backstage template's tag, and
    the newest CHANGELOG heading all say the same."""
    version = tomllib.loads((TEMPLATE / "runtime" / "pyproject.toml").read_text())["project"][
        "version"]
    infra = tomllib.loads((TEMPLATE / "infra" / "pyproject.toml").read_text())["project"]
    assert infra["version"] == version
    assert f"worker-runtime=={version}" in infra["dependencies"]
    baked = (TEMPLATE / "{{cookiecutter.project}}" / "pyproject.toml").read_text()
    pins = re.findall(r'"worker-runtime(?:\[[a-z,]+\])?==([^"]+)"', baked)
    assert pins and set(pins) == {version}, pins
    answers = json.loads((TEMPLATE / "cookiecutter.json").read_text())
    assert answers["template_ref"] == f"v{version}"
    assert f"default: v{version}" in (TEMPLATE / "template.yaml").read_text()
    headings = CHANGELOG_HEADING.findall((TEMPLATE / "CHANGELOG.md").read_text())
    assert headings and headings[0] == version, headings


def test_a_bake_records_its_checkout_and_commit_and_writes_nothing_there(
        tmp_path: Path) -> None:
    """A bake of a local git checkout records the source as given, the checkout and its
    commit; the hook leaves the checkout's git files as they were (no index refresh)."""
    repo = tmp_path / "template"
    shutil.copytree(TEMPLATE, repo, ignore=shutil.ignore_patterns(
        ".venv", "build", "node_modules", "*.egg-info", "__pycache__", ".*_cache", ".git"))
    for command in (["init", "-q"], ["add", "-A"],
                    ["-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-qm", "t"]):
        git(repo, *command)
    (repo / "README.md").write_text("an uncommitted edit\n")  # git status would refresh the index
    before = {p: p.stat().st_mtime_ns for p in (repo / ".git").rglob("*") if p.is_file()}
    project = cookiecutter_in(repo, ".", tmp_path / "out")
    after = {p: p.stat().st_mtime_ns for p in (repo / ".git").rglob("*") if p.is_file()}
    assert after == before
    source = recorded(project)
    assert source == {"TEMPLATE_SOURCE": ".", "TEMPLATE_DIR": str(repo),
                      "TEMPLATE_COMMIT": git(repo, "rev-parse", "HEAD")}, source
    assert "uncommitted changes" in (project / "template-source.mk").read_text()


def test_a_bake_of_a_remote_template_records_no_checkout(tmp_path: Path) -> None:
    """cookiecutter's clone of a git URL is not the team's checkout: the source only, so make
    install and make infra-install take the pins."""
    project = bake_project(tmp_path, template_repo="https://github.com/example-org/worker-template")
    assert recorded(project)["TEMPLATE_DIR"] == str(TEMPLATE)
    clone = cookiecutter_in(tmp_path, f"git+file://{TEMPLATE}", tmp_path / "remote",
                            env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    source = recorded(clone)
    assert source == {"TEMPLATE_SOURCE": f"git+file://{TEMPLATE}", "TEMPLATE_DIR": "",
                      "TEMPLATE_COMMIT": ""}, source


def offline(*command: str) -> list[str]:
    """``command`` in a network namespace of its own: loopback only (no DNS, no route)."""
    return ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "offline", *command]


@pytest.mark.slow
def test_a_fresh_bake_of_this_checkout_installs_tests_and_renders_offline(
        tmp_path: Path) -> None:
    """The wheelhouse filled once (make wheelhouse, with the index), then in a fresh bake of
    this checkout with no network and no variable: make install (worker-runtime from the
    commit the bake recorded), make test, make infra-install (worker-infra and worker-runtime
    from that commit), make manifests STACK=dev."""
    if shutil.which("unshare") is None or subprocess.run(
            offline("true"), capture_output=True, check=False).returncode != 0:
        pytest.skip("no network namespace here (unshare -n)")
    filled = subprocess.run([sys.executable, str(TEMPLATE / "scripts" / "wheelhouse.py")],
                            capture_output=True, text=True, timeout=1800, check=False)
    assert filled.returncode == 0, filled.stdout[-2000:] + filled.stderr[-3000:]
    project = bake_project(tmp_path, project="offline-worker")
    commit = git(TEMPLATE, "rev-parse", "HEAD")
    assert recorded(project)["TEMPLATE_COMMIT"] == commit
    done = make(project, "install", timeout=1200, wrap=offline)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.startswith(
        f"no active venv: creating .venv\nworker-runtime: from commit {commit} of {TEMPLATE} "
        f"(template-source.mk); dependencies from the wheelhouse {TEMPLATE}/build/wheelhouse "
        "(no network)"), done.stdout[:600]
    origin = json.loads(subprocess.run(
        [str(project / ".venv" / "bin" / "python"), "-c",
         "from importlib.metadata import distribution as d; "
         + "print(d('worker-runtime').read_text('direct_url.json'))"],
        capture_output=True, text=True, timeout=60, check=True).stdout)
    assert origin["url"] == f"file://{TEMPLATE}" and origin["subdirectory"] == "runtime"
    assert origin["vcs_info"]["commit_id"] == commit, origin
    for target, timeout in (("test", 900), ("infra-install", 1200), ("manifests", 600)):
        done = make(project, target, "STACK=dev", timeout=timeout, wrap=offline)
        assert done.returncode == 0, target + done.stdout[-3000:] + done.stderr[-3000:]
    assert (project / "build" / "manifests" / "dev.yaml").stat().st_size > 0


PLANTED = "planted: a line of worker-runtime 0.1.1"


def template_repo(path: Path) -> Path:
    """A git repository of this checkout's files (committed), sharing its wheelhouse."""
    shutil.copytree(TEMPLATE, path, ignore=shutil.ignore_patterns(
        ".venv", "build", "node_modules", "*.egg-info", "__pycache__", ".*_cache", ".git"))
    git(path, "init", "-q")
    commit(path, "the template")
    (path / "build").mkdir()
    (path / "build" / "wheelhouse").symlink_to(TEMPLATE / "build" / "wheelhouse")
    return path


def commit(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-qm", message)
    return git(repo, "rev-parse", "HEAD")


def plant_a_runtime_change(repo: Path) -> str:
    """worker-runtime 0.1.1: `config` prints one more line; the version moved everywhere
    (scripts/bump_version.py), nothing else. The new commit."""
    main = repo / "runtime" / "worker_runtime" / "cli" / "main.py"
    last_row = '        print(f"{key:<{width}}  {value:<{value_width}}  {source}")\n'
    assert last_row in main.read_text()
    main.write_text(main.read_text().replace(last_row, f"{last_row}    print({PLANTED!r})\n"))
    subprocess.run([sys.executable, str(repo / "scripts" / "bump_version.py"), "0.1.1"],
                   check=True, capture_output=True, timeout=60)
    return commit(repo, "worker-runtime 0.1.1: a planted change")


def changed_files(old: Path, new: Path) -> dict[str, list[str]]:
    """The lines that differ between two bakes, per file (what cruft update would apply)."""
    done = subprocess.run(["git", "diff", "--no-index", "-U0", "--no-prefix", str(old),
                           str(new)], capture_output=True, text=True, timeout=60, check=False)
    files: dict[str, list[str]] = {}
    name = ""
    for line in done.stdout.splitlines():
        if line.startswith("+++ "):
            name = Path(line[4:]).relative_to(new.relative_to("/")).as_posix()
        elif line.startswith(("+", "-")) and not line.startswith("--- "):
            files.setdefault(name, []).append(line)
    return files


def test_a_runtime_only_change_reaches_a_bake_as_its_pins_alone(tmp_path: Path) -> None:
    """cookiecutter's bake, with the same (default) answers, of the template before and after
    a runtime-only change (what `cruft update` applies): the two bakes differ only where the
    version or the commit is written: the pins (pyproject.toml's worker-runtime,
    infra/requirements.txt's tag, template-source.mk's commit) and the catalog's docs link."""
    repo = template_repo(tmp_path / "template")
    old_commit = git(repo, "rev-parse", "HEAD")
    before = cookiecutter_in(repo, str(repo), tmp_path / "before")
    new_commit = plant_a_runtime_change(repo)
    after = cookiecutter_in(repo, str(repo), tmp_path / "after")
    files = changed_files(before, after)
    assert set(files) <= {"pyproject.toml", "infra/requirements.txt", "template-source.mk",
                          "catalog-info.yaml"}, files
    assert files["pyproject.toml"] == ['-    "worker-runtime[postgres,sandbox]==0.1.0",',
                                       '+    "worker-runtime[postgres,sandbox]==0.1.1",']
    for name, lines in files.items():
        removed = [line[1:] for line in lines if line.startswith("-")]
        added = [line[1:] for line in lines if line.startswith("+")]
        moved = [line.replace("0.1.0", "0.1.1").replace(old_commit, new_commit)
                 for line in removed]
        assert moved == added, (name, lines)


@pytest.mark.slow
def test_an_upgrade_is_one_pin_and_the_service_suite_stays_green(tmp_path: Path) -> None:
    """A service baked at 0.1.0 (make install, no network); the runtime changes (a planted
    line in `config`, version 0.1.1); the service moves its pin (pyproject.toml's version and
    the recorded commit) and nothing else: make install brings the change, make test is green."""
    if not (TEMPLATE / "build" / "wheelhouse").is_dir():
        pytest.skip("no wheelhouse: make wheelhouse (test_a_fresh_bake_... fills it)")
    repo = template_repo(tmp_path / "template")
    project = cookiecutter_in(repo, str(repo), tmp_path / "service")
    git(project, "init", "-q")
    commit(project, "baked")
    done = make(project, "install", timeout=1200, wrap=offline)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    python = str(project / ".venv" / "bin" / "python")

    def config() -> str:
        env = project_env(project, WORKER_POOL="interactive")
        done = subprocess.run([python, "-m", "orders_worker", "config"], cwd=project, env=env,
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    assert PLANTED not in config()
    new = plant_a_runtime_change(repo)
    # The pin moved, as cruft update moves it (the test above): two lines.
    pyproject = project / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("==0.1.0\",", "==0.1.1\","))
    source = project / "template-source.mk"
    old = recorded(project)["TEMPLATE_COMMIT"]
    source.write_text(source.read_text().replace(old, new))
    assert git(project, "diff", "--name-only").split() == ["pyproject.toml", "template-source.mk"]
    done = make(project, "install", timeout=1200, wrap=offline)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert PLANTED in config()
    done = make(project, "test", timeout=900, wrap=offline)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
