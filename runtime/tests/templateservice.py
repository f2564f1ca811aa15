"""The runtime's test service: the template's own service package and pools.toml, rendered.

The runtime's tests run a service without a bake: ``src/{{cookiecutter.package}}/`` and
``pools.toml`` of the template, rendered with Jinja from cookiecutter.json's defaults
(every option on: the database and the sandbox pool), the package named ``service`` and the
project ``test-service``, into ``.service/`` here (git ignores it). No copy to drift: a
change to an example actor or to the shipped pools.toml is what these tests run.

``python tests/templateservice.py`` renders it (``make lint`` does, before mypy); the
conftest does at import. Files are written only when their text changed, each atomically
(pytest-xdist's workers render at once).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import jinja2

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE.parents[1]
PROJECT = TEMPLATE / "{{cookiecutter.project}}"
SOURCE = PROJECT / "src" / "{{cookiecutter.package}}"
#: The rendered service's project folder (its pools.toml); the package is ``src/service``.
HOME = HERE / ".service"
SRC = HOME / "src"
ANSWERS = {
    "project": "test-service",
    "package": "service",
    "database": "postgres",
    "sandbox_pool": "yes",
}


def pythonpath() -> str:
    """PYTHONPATH for a process that runs the test service (``python -m service``)."""
    return os.pathsep.join([str(SRC), str(HERE)])


def context() -> dict[str, Any]:
    """cookiecutter.json's defaults (a list's first choice), with :data:`ANSWERS`, each value
    rendered with the values before it as cookiecutter does."""
    found: dict[str, Any] = {}
    for key, value in json.loads((TEMPLATE / "cookiecutter.json").read_text()).items():
        if key.startswith("_"):
            continue
        value = ANSWERS.get(key, value[0] if isinstance(value, list) else value)
        if isinstance(value, str):
            value = jinja2.Template(value).render(cookiecutter=found)
        found[key] = value
    return found


def _write(path: Path, text: str) -> None:
    if path.is_file() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(temporary, path)


def render() -> Path:
    """Render the service into :data:`HOME`; return the folder to put on the path."""
    answers = context()

    def rendered(path: Path) -> str:
        template = jinja2.Template(path.read_text(), keep_trailing_newline=True)
        text: str = template.render(cookiecutter=answers)
        return text

    for source in sorted(SOURCE.rglob("*.py")):
        if "__pycache__" not in source.parts:
            _write(SRC / "service" / source.relative_to(SOURCE), rendered(source))
    _write(HOME / "pools.toml", rendered(PROJECT / "pools.toml"))
    return SRC


if __name__ == "__main__":
    print(f"rendered the test service into {render()}")
