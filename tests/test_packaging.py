"""The template's packaging (#40 items 4 and 5): one version for worker-runtime and
worker-infra, a bake that records where it came from, a fresh bake of a local checkout
that installs, tests and renders with no network and no variable to set, lock files of the
versions the template's CI tests in every bake (the image installs from them), and
`cruft update` across a runtime-only change that touches the pins alone."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import dockerbuild
import pytest
from packaging.utils import canonicalize_name
from bakery import TEMPLATE, RedisServer, bake_project, free_port, make, project_env, wait_for

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
    assert answers["_template_ref"] == f"v{version}"
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


@pytest.fixture(scope="module")
def wheelhouse() -> Path:
    """build/wheelhouse filled (make wheelhouse, with the index: the one step that needs
    it), once per module and xdist worker: scripts/wheelhouse.py fills take turns and rename
    a complete folder into place, so a test never reads one half filled. The tests then cut
    the network: skipped on a desk without unshare -n, failed in CI (``CI`` set)."""
    if shutil.which("unshare") is None or subprocess.run(
            offline("true"), capture_output=True, check=False).returncode != 0:
        reason = "no network namespace here (unshare -n)"
        if os.environ.get("CI"):
            pytest.fail(reason + "; CI runs as root, where it works", pytrace=False)
        pytest.skip(reason)
    filled = subprocess.run([sys.executable, str(TEMPLATE / "scripts" / "wheelhouse.py")],
                            capture_output=True, text=True, timeout=1800, check=False)
    assert filled.returncode == 0, filled.stdout[-2000:] + filled.stderr[-3000:]
    return TEMPLATE / "build" / "wheelhouse"


@pytest.mark.slow
def test_a_fresh_bake_of_this_checkout_installs_tests_and_renders_offline(
        tmp_path: Path, wheelhouse: Path) -> None:
    """With the wheelhouse filled, in a fresh bake of this checkout with no network and no
    variable: make install (worker-runtime from the commit the bake recorded, its
    dependencies at the versions of the lock the bake carries), make test, make
    infra-install (worker-infra and worker-runtime from that commit), make manifests."""
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
def test_an_upgrade_is_one_pin_and_the_service_suite_stays_green(
        tmp_path: Path, wheelhouse: Path) -> None:
    """A service baked at 0.1.0 (make install, no network, from the wheelhouse); the runtime
    changes (a planted line in `config`, version 0.1.1); the service moves its pin
    (pyproject.toml's version and the recorded commit) and nothing else: make install brings
    the change, make test is green."""
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


# -- The lock files every bake carries, and the image installed from them -------------------

LOCKS_SCRIPT = Path("scripts") / "locks.py"
LOCK_DIR = Path("{{cookiecutter.project}}") / "locks"


def check_locks(template: Path) -> subprocess.CompletedProcess[str]:
    """`scripts/locks.py --check` of the template checkout (or copy) ``template``."""
    return subprocess.run([sys.executable, str(template / LOCKS_SCRIPT), "--check"],
                          capture_output=True, text=True, timeout=600, check=False)


def test_every_bake_carries_the_fresh_lock_pair_of_its_python_and_options(
        tmp_path: Path) -> None:
    """The template's lock files are fresh (scripts/locks.py --check: every dependency the
    bakes declare, transitively, locked with hashes at the CI's versions); a bake keeps its
    own pair as requirements.lock and requirements-dev.lock and no other."""
    done = check_locks(TEMPLATE)
    assert done.returncode == 0, done.stderr[-3000:]
    project = bake_project(tmp_path, python_version="3.12", database="none", sandbox_pool="yes")
    assert not (project / "locks").exists()
    for name, stem in (("requirements.lock", "runtime-sandbox.lock"),
                       ("requirements-dev.lock", "runtime-sandbox-dev.lock")):
        assert (project / name).read_text() == (TEMPLATE / LOCK_DIR / "3.12" / stem).read_text()
    assert "psycopg" not in (project / "requirements.lock").read_text()
    assert "pyseccomp==" in (project / "requirements.lock").read_text()


def test_a_lock_missing_a_dependency_the_bake_declares_is_stale(tmp_path: Path) -> None:
    """A dependency added to the bake's pyproject.toml, then a transitive one (pydantic's
    annotated-types) taken out of one lock: each fails the check, naming it."""
    copy = tmp_path / "template"
    shutil.copytree(TEMPLATE, copy, ignore=shutil.ignore_patterns(
        ".venv", "build", "node_modules", "*.egg-info", "__pycache__", ".*_cache", ".git",
        "tests", "bench", "docs"))
    pyproject = copy / "{{cookiecutter.project}}" / "pyproject.toml"
    declared = pyproject.read_text()
    pyproject.write_text(declared.replace("dependencies = [\n",
                                          'dependencies = [\n    "toolz>=0.12",\n', 1))
    done = check_locks(copy)
    assert done.returncode == 1, done.stderr
    stale = done.stderr.splitlines()
    assert sum("toolz (required by the bake) is not locked" in line
               for line in stale) == 24, stale[:5]
    assert stale[-1] == "run `make locks` at worker-template's root and commit the files"
    pyproject.write_text(declared)
    lock = copy / LOCK_DIR / "3.11" / "runtime-postgres-sandbox.lock"
    lines = lock.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("annotated-types=="))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith(" "))
    lock.write_text("".join(lines[:start] + lines[end:]))
    done = check_locks(copy)
    assert done.returncode == 1, done.stderr
    stale = [line for line in done.stderr.splitlines() if line.startswith("stale lock")]
    assert len(stale) == 1 and re.fullmatch(
        r"stale lock: runtime-postgres-sandbox\.lock: annotated-types \(required by "
        r"pydantic==[\d.]+\) is not locked", stale[0]), stale


def readyz(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.HTTPError):
        return False


@pytest.mark.slow
def test_the_image_installs_offline_from_the_lock_and_the_runtime_wheel(
        tmp_path: Path, wheelhouse: Path) -> None:
    """A fresh bake: `make wheel` builds worker-runtime's wheel from the recorded commit,
    then the Dockerfile's build stage runs as a builder runs it (its own RUN lines, read
    from the Dockerfile: tests/dockerbuild.py) into a fresh venv with no network, pip
    finding the wheelhouse: the locked dependencies with their hashes checked, the wheel,
    the service. The image's command then starts from that venv alone and is ready."""
    project = bake_project(tmp_path, project="image-worker")
    # (the venv of make install builds it: this one, to spare the test an install)
    done = make(project, "wheel", f"PYTHON={sys.executable}", timeout=600, wrap=offline)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    commit = git(TEMPLATE, "rev-parse", "HEAD")
    assert f"wheel: worker-runtime from commit {commit}" in done.stdout, done.stdout
    version = tomllib.loads((TEMPLATE / "runtime" / "pyproject.toml").read_text())["project"][
        "version"]
    assert [p.name for p in (project / "build" / "wheels").iterdir()] == [
        f"worker_runtime-{version}-py3-none-any.whl"]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = {"PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path),
           "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheelhouse),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    dockerfile = project / "Dockerfile"
    started = time.monotonic()
    dockerbuild.run_stage(dockerbuild.stage(dockerfile, "build"), project, tmp_path / "root",
                          env, {"PREFIX": str(venv)}, offline)
    print(f"the image's install: {time.monotonic() - started:.0f} s", file=sys.stderr)
    python = str(venv / "bin" / "python")
    freeze = subprocess.run([python, "-m", "pip", "freeze"], capture_output=True, text=True,
                            timeout=120, check=True).stdout
    locked = (project / "requirements.lock").read_text()
    for line in freeze.splitlines():
        if "==" in line and not line.startswith(("image-worker", "worker-runtime")):
            name, _, version = line.partition("==")
            pin = re.escape(f"{canonicalize_name(name)}=={version}")
            assert re.search(rf"^{pin} [;\\]", locked, re.MULTILINE), line
    assert "worker-runtime @ file://" in freeze  # the wheel, not an index
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    server.start()
    command = dockerbuild.final_command(dockerfile)
    assert command == ["image-worker", "worker"]
    port = free_port()
    worker = subprocess.Popen(
        [str(venv / "bin" / command[0]), *command[1:]], cwd=tmp_path,
        env={**env, "WORKER_POOLS_FILE": str(project / "pools.toml"), "REDIS_URL": server.url,
             "WORKER_POOL": "interactive", "WORKER_STATE_DIR": str(tmp_path / "state"),
             "METRICS_PORT": str(port), "WORKER_PROCESSES": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: readyz(port) or worker.poll() is not None, 60, "/readyz")
        assert worker.poll() is None and readyz(port)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        output = worker.communicate(timeout=30)[0].decode()
        server.stop()
    assert "Traceback" not in output, output[-3000:]


# -- cruft update across a runtime-only change ----------------------------------------------

CRUFT = Path(sys.executable).parent / "cruft"
PIN_FILES = {"pyproject.toml", "infra/requirements.txt", "requirements.lock",
             "requirements-dev.lock", "template-source.mk", ".cruft.json",
             "catalog-info.yaml"}  # (catalog-info.yaml: its docs link names the version's tag)


def test_cruft_update_across_a_runtime_only_change_moves_the_pins_alone(tmp_path: Path) -> None:
    """A service created by `cruft create` from a checkout at commit A (recording that
    checkout and A); the runtime changes (commit B: a planted line, the version bumped by
    scripts/bump_version.py); `cruft update` applies cleanly and touches the pins alone:
    worker-runtime's in pyproject.toml, infra/requirements.txt's tag, the recorded commit
    (template-source.mk, .cruft.json)."""
    repo = template_repo(tmp_path / "template")
    old = git(repo, "rev-parse", "HEAD")
    env = {**os.environ, "HOME": str(tmp_path)}
    created = subprocess.run([str(CRUFT), "create", str(repo), "--no-input", "--output-dir",
                              str(tmp_path / "out")], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300, check=False)
    assert created.returncode == 0, created.stdout + created.stderr
    project = tmp_path / "out" / "orders-worker"
    assert recorded(project) == {"TEMPLATE_SOURCE": str(repo), "TEMPLATE_DIR": str(repo),
                                 "TEMPLATE_COMMIT": old}
    git(project, "init", "-q")
    commit(project, "created")
    new = plant_a_runtime_change(repo)
    updated = subprocess.run([str(CRUFT), "update", "--skip-apply-ask"], cwd=project, env=env,
                             capture_output=True, text=True, timeout=300, check=False)
    assert updated.returncode == 0, updated.stdout + updated.stderr
    assert "has been updated" in updated.stdout, updated.stdout + updated.stderr
    changed = set(git(project, "diff", "--name-only", "HEAD").split())
    changed |= set(git(project, "ls-files", "--others", "--exclude-standard").split())
    assert changed <= PIN_FILES and {"pyproject.toml", "infra/requirements.txt",
                                     "template-source.mk", ".cruft.json"} <= changed, changed
    diff = git(project, "diff", "-U0", "HEAD", "--", *sorted(changed - {".cruft.json"}))
    removed = [line[1:] for line in diff.splitlines() if line[:1] == "-" and line[:3] != "---"]
    added = [line[1:] for line in diff.splitlines() if line[:1] == "+" and line[:3] != "+++"]
    assert [line.replace("0.1.0", "0.1.1").replace(old, new) for line in removed] == added
    assert '    "worker-runtime[postgres,sandbox]==0.1.1",' in added
    assert recorded(project)["TEMPLATE_COMMIT"] == new
    assert json.loads((project / ".cruft.json").read_text())["commit"] == new


@pytest.mark.slow
def test_the_real_image_builds_from_the_lock_and_the_runtime_wheel(tmp_path: Path) -> None:
    """The bake's Dockerfile built for real (buildah, on make e2e-build's local base, with the
    package index: scripts/e2e/images.py) after `make wheel`: the lock installs with its
    hashes checked, and worker-runtime in the image is the wheel of the recorded commit, the
    service importable with no network. Skipped where the base is not built (it takes 2 min)."""
    sys.path.insert(0, str(TEMPLATE / "scripts" / "e2e"))
    import build
    import images

    cache = build.cache_dir()
    if shutil.which("buildah") is None or os.geteuid() != 0 or not images.has_image(
            cache, images.base_ref()):
        pytest.skip("no buildah, not root, or no e2e base image (make e2e-build)")
    project = bake_project(tmp_path, project="image-worker")
    done = make(project, "wheel", f"PYTHON={sys.executable}", timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ref = "localhost/image-worker:packaging"
    images.bake_image(cache, project, ref)
    container = images.buildah(cache, "from", ref, capture=True).split()[-1]
    try:
        said = images.buildah(
            cache, "run", "--network", "none", container, "--", "python3", "-c",
            "from importlib.metadata import distribution as d; import image_worker; "
            "print(d('worker-runtime').read_text('direct_url.json'))", capture=True)
    finally:
        images.buildah(cache, "rm", container)
    wheel = next((project / "build" / "wheels").iterdir()).name
    assert json.loads(said.strip().splitlines()[-1])["url"] == f"file:///build/{wheel}", said
