"""Generate template.yaml, the Backstage Software Template of this cookiecutter.

    python scripts/backstage_template.py           # print it
    python scripts/backstage_template.py --write   # rewrite template.yaml

One source: the parameters, their labels (``__prompts__``), defaults and choice lists come
from cookiecutter.json, and the validation patterns from the compiled regular expressions
of hooks/pre_gen_project.py, so the portal's form and ``cookiecutter`` cannot drift
(tests/test_backstage.py fails when template.yaml is stale). The hook still runs under
``fetch:cookiecutter`` and refuses what a JSON schema cannot say (names that shadow a
dependency, image tags).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

TEMPLATE = Path(__file__).resolve().parents[1]
COOKIECUTTER = TEMPLATE / "cookiecutter.json"
HOOK = TEMPLATE / "hooks" / "pre_gen_project.py"
OUTPUT = TEMPLATE / "template.yaml"
HEADER = (
    "# Backstage Software Template: GENERATED from cookiecutter.json and the hook's checks by\n"
    "# scripts/backstage_template.py. Do not edit; register this file in the catalog.\n"
)
#: Answer -> (the hook's pattern constant, maxLength or None).
VALIDATION = {
    "project": ("PROJECT_SLUG", 40),
    "package": ("PACKAGE_NAME", None),
    "k8s_namespace": ("DNS_LABEL", 55),
    "image": ("IMAGE_NAME", None),
    "template_repo": ("TEMPLATE_REPO", None),
    "owner": ("ENTITY_REF", None),
    "system": ("SYSTEM_REF", None),
    "grafana_url": ("HTTP_URL", None),
}
#: Form pages: title -> answers, in cookiecutter.json's order within each.
PAGES = {
    "Service": ("project", "package", "description", "python_version", "database",
                "sandbox_pool"),
    "Deployment": ("k8s_namespace", "image", "template_repo"),
    "Catalog": ("owner", "system", "grafana_url"),
}
#: Catalog answers picked from the catalog with Backstage's own fields, not typed.
PICKERS = {
    "owner": {"ui:field": "OwnerPicker",
              "ui:options": {"catalogFilter": [{"kind": ["Group", "User"]}]}},
    "system": {"ui:field": "EntityPicker",
               "ui:options": {"catalogFilter": [{"kind": "System"}], "defaultKind": "System",
                              "defaultNamespace": "default"}},
}
#: Answers the form does not ask: derived from the Repository page's repoUrl.
_REPO = "parameters.repoUrl | parseRepoUrl"
FROM_REPOSITORY = {
    "repo_url": "https://${{ %s | pick('host') }}/${{ %s | pick('owner') }}/${{ %s | pick('repo') }}"
    % (_REPO, _REPO, _REPO),
}


def hook_patterns() -> dict[str, re.Pattern[str]]:
    """The hook's compiled patterns (the hook is valid Python before rendering)."""
    source = HOOK.read_text().replace("{{ cookiecutter | tojson }}", "{}")
    source = source.replace("{{ _cookiecutter | default({}) | tojson }}", "{}")
    namespace: dict[str, Any] = {"__name__": "pre_gen_project"}
    exec(compile(source, str(HOOK), "exec"), namespace)  # noqa: S102  (our own hook)
    return {k: v for k, v in namespace.items() if isinstance(v, re.Pattern)}


def is_derived(default: Any) -> bool:
    return isinstance(default, str) and "{{" in default


def said(default: str) -> str:
    """A derived default in words, without cookiecutter's Jinja (the portal shows it)."""
    text = re.sub(r"\{\{\s*cookiecutter\.project\s*\|\s*replace\('-',\s*'_'\)\s*\}\}",
                  "the project name with - as _", default)
    text = re.sub(r"\{\{\s*cookiecutter\.(\w+)\s*\}\}", r"<\1>", text)
    if "{{" in text or "{%" in text:
        raise SystemExit(f"a derived default the form cannot say in words: {default}")
    return text


def parameter(name: str, default: Any, label: str, patterns: dict[str, re.Pattern[str]]) -> dict[str, Any]:
    prop: dict[str, Any] = {"title": label, "type": "string"}
    if isinstance(default, list):
        prop["enum"] = list(default)
        prop["default"] = default[0]
    elif is_derived(default):
        prop["description"] = f"Leave empty for the default: {said(default)}"
    else:
        prop["default"] = default
    if name in VALIDATION:
        constant, max_length = VALIDATION[name]
        prop["pattern"] = patterns[constant].pattern  # Python and ECMA-262 alike
        if max_length is not None:
            prop["maxLength"] = max_length
    prop.update(PICKERS.get(name, {}))
    return prop


def template() -> dict[str, Any]:
    context = json.loads(COOKIECUTTER.read_text())
    prompts = context.pop("__prompts__")
    patterns = hook_patterns()
    answers = [key for key in context if not key.startswith("_")]
    paged = [name for names in PAGES.values() for name in names]
    if sorted(paged + list(FROM_REPOSITORY)) != sorted(answers):
        raise SystemExit(f"PAGES must list every answer of cookiecutter.json: {answers}")
    pages = []
    for title, names in PAGES.items():
        props = {n: parameter(n, context[n], prompts[n], patterns) for n in names}
        required = [n for n in names if not is_derived(context[n])]
        pages.append({"title": title, "required": required, "properties": props})
    pages.append(
        {
            "title": "Repository",
            "required": ["repoUrl"],
            "properties": {
                "repoUrl": {
                    "title": "Repository location",
                    "type": "string",
                    "ui:field": "RepoUrlPicker",
                    "ui:options": {"allowedHosts": ["github.com"]},
                }
            },
        }
    )
    values = {
        name: FROM_REPOSITORY.get(name, "${{ parameters.%s }}" % name)  # noqa: UP031
        for name in answers  # (Backstage's own template syntax)
    }
    return {
        "apiVersion": "scaffolder.backstage.io/v1beta3",
        "kind": "Template",
        "metadata": {
            "name": "worker-template",
            "title": "Dramatiq worker service",
            "description": "A Dramatiq worker service with its pools, alerts, CI and "
            "Kubernetes infrastructure (worker-template).",
            "tags": ["python", "dramatiq", "worker", "kubernetes"],
        },
        "spec": {
            "owner": context["owner"],
            "type": "service",
            "parameters": pages,
            "steps": [
                {
                    "id": "bake",
                    "name": "Bake the service",
                    "action": "fetch:cookiecutter",
                    "input": {"url": "./", "values": values},
                },
                {
                    "id": "publish",
                    "name": "Publish",
                    "action": "publish:github",
                    "input": {
                        "repoUrl": "${{ parameters.repoUrl }}",
                        "description": "${{ parameters.description }}",
                        "defaultBranch": "main",
                    },
                },
                {
                    "id": "register",
                    "name": "Register in the catalog",
                    "action": "catalog:register",
                    "input": {
                        "repoContentsUrl": "${{ steps.publish.output.repoContentsUrl }}",
                        "catalogInfoPath": "/catalog-info.yaml",
                    },
                },
            ],
            "output": {
                "links": [
                    {"title": "Repository", "url": "${{ steps.publish.output.remoteUrl }}"},
                    {
                        "title": "Open in catalog",
                        "icon": "catalog",
                        "entityRef": "${{ steps.register.output.entityRef }}",
                    },
                ]
            },
        },
    }


def render() -> str:
    return HEADER + yaml.safe_dump(template(), sort_keys=False, width=100, allow_unicode=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite template.yaml")
    args = parser.parse_args()
    if args.write:
        OUTPUT.write_text(render())
        print(f"wrote {OUTPUT.relative_to(TEMPLATE)}")
    else:
        sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
