"""Move the template's one version (worker-runtime's and worker-infra's) to NEW everywhere
it is written: runtime/pyproject.toml (the source), infra/pyproject.toml (its version and
its dependency on worker-runtime), the bake's pins (pyproject.toml), cookiecutter.json's
``_template_ref`` (the tag infra/requirements.txt pins: a private variable, so ``cruft
update`` takes the new one), and a new CHANGELOG.md heading. tests/test_packaging.py checks
they agree.

    python scripts/bump_version.py 0.2.0
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1]
VERSION = re.compile(r"^\d+\.\d+\.\d+$")


def current(root: Path) -> str:
    text = (root / "runtime" / "pyproject.toml").read_text()
    return str(tomllib.loads(text)["project"]["version"])


def rewrite(path: Path, *pairs: tuple[str, str]) -> None:
    text = path.read_text()
    for old, new in pairs:
        if old not in text:
            raise SystemExit(f"bump_version: {path} has no {old!r}")
        text = text.replace(old, new)
    path.write_text(text)


def bump(root: Path, new: str) -> str:
    """Every copy of the version moved to ``new``; the old version."""
    old = current(root)
    rewrite(root / "runtime" / "pyproject.toml", (f'version = "{old}"', f'version = "{new}"'))
    rewrite(root / "infra" / "pyproject.toml", (f'version = "{old}"', f'version = "{new}"'),
            (f'"worker-runtime=={old}"', f'"worker-runtime=={new}"'))
    rewrite(root / "{{cookiecutter.project}}" / "pyproject.toml", (f'=={old}",', f'=={new}",'))
    rewrite(root / "cookiecutter.json",
            (f'"_template_ref": "v{old}"', f'"_template_ref": "v{new}"'))
    changelog = root / "CHANGELOG.md"
    heading = f"\n## {new} (unreleased)\n\n## "
    changelog.write_text(changelog.read_text().replace("\n## ", heading, 1))
    return old


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not VERSION.match(argv[0]):
        print("usage: bump_version.py X.Y.Z", file=sys.stderr)
        return 2
    old = bump(TEMPLATE, argv[0])
    print(f"bump_version: {old} -> {argv[0]}; write its CHANGELOG.md entries, then tag v{argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
