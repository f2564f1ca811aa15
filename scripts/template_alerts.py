"""Regenerate the template's ``{{cookiecutter.project}}/ops/alerts.yaml`` (Jinja).

    python scripts/template_alerts.py           rewrite it
    python scripts/template_alerts.py --check   exit 1 when it is stale

A bake's ops/alerts.yaml is what its ``make alerts`` writes (worker_infra.alerts, from
its pools.toml). This bakes the four shapes (database x sandbox pool) with placeholder
names, runs each bake's ``infra/alerts.py``, and merges the four files into one Jinja
template: a line kept by every shape is plain, one a shape drops is wrapped in its
``{% if %}``, the placeholders become ``{{ cookiecutter.project }}`` and
``{{ cookiecutter.k8s_namespace }}``. Run it after changing worker_infra's rules.
"""

from __future__ import annotations

import argparse
import difflib
import subprocess
import sys
import tempfile
from pathlib import Path

from cookiecutter.main import cookiecutter

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "{{cookiecutter.project}}" / "ops" / "alerts.yaml"
PROJECT = "zzproject"
NAMESPACE = "zznamespace"
SHAPES = {
    (True, True): {"database": "postgres", "sandbox_pool": "yes"},
    (False, True): {"database": "none", "sandbox_pool": "yes"},
    (True, False): {"database": "postgres", "sandbox_pool": "no"},
    (False, False): {"database": "none", "sandbox_pool": "no"},
}


def baked_rules(folder: Path, context: dict[str, str]) -> list[str]:
    out = folder / "-".join(context.values())
    project = Path(
        cookiecutter(
            str(REPO),
            no_input=True,
            output_dir=str(out),
            extra_context={**context, "project": PROJECT, "k8s_namespace": NAMESPACE},
        )
    )
    subprocess.run(
        [sys.executable, str(project / "infra" / "alerts.py")],
        check=True,
        capture_output=True,
    )
    return (project / "ops" / "alerts.yaml").read_text().splitlines(keepends=True)


def condition(database: bool, sandbox: bool) -> str:
    parts = []
    if not database:
        parts.append('cookiecutter.database == "postgres"')
    if not sandbox:
        parts.append('cookiecutter.sandbox_pool == "yes"')
    return " and ".join(parts)


def template() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        texts = {shape: baked_rules(Path(tmp), ctx) for shape, ctx in SHAPES.items()}
    full = texts[(True, True)]
    present = [dict.fromkeys(SHAPES, True) for _ in full]
    for shape, lines in texts.items():
        matcher = difflib.SequenceMatcher(a=full, b=lines, autojunk=False)
        for tag, i1, i2, _j1, _j2 in matcher.get_opcodes():
            if tag == "insert" or tag == "replace":
                raise SystemExit(
                    f"shape {SHAPES[shape]} has lines the full shape lacks"
                )
            if tag == "delete":
                for i in range(i1, i2):
                    present[i][shape] = False
    out: list[str] = []
    current = ""
    for line, where in zip(full, present, strict=True):
        needs = [s for s, kept in where.items() if not kept]
        cond = ""
        if needs:
            if all(not db for db, _ in needs) and len(needs) == 2:
                cond = 'cookiecutter.database == "postgres"'
            elif all(not sb for _, sb in needs) and len(needs) == 2:
                cond = 'cookiecutter.sandbox_pool == "yes"'
            elif len(needs) == 3:
                cond = 'cookiecutter.database == "postgres" and cookiecutter.sandbox_pool == "yes"'
            else:
                raise SystemExit(f"line kept by an odd set of shapes: {line!r}")
        if cond != current:
            if current:
                out.append("{% endraw %}{% endif %}{% raw %}")
            if cond:
                out.append(f"{{% endraw %}}{{% if {cond} %}}{{% raw %}}")
            current = cond
        out.append(
            line.replace(
                PROJECT, "{% endraw %}{{ cookiecutter.project }}{% raw %}"
            ).replace(
                NAMESPACE, "{% endraw %}{{ cookiecutter.k8s_namespace }}{% raw %}"
            )
        )
    if current:
        out.append("{% endraw %}{% endif %}{% raw %}")
    return "{% raw %}" + "".join(out) + "{% endraw %}"  # the content ends its last line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    text = template()
    if args.check:
        if TARGET.read_text() != text:
            print(
                f"{TARGET.relative_to(REPO)} is stale: run scripts/template_alerts.py"
            )
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
