"""Refuse bad answers before anything is written.

Valid Python before rendering: the answers are read through ``tojson``. Each
check is a small function that returns the problem, or None; the hook prints one
line per problem (naming the answer and the rule) and exits 1.
"""

from __future__ import annotations

import json
import keyword
import re
import sys

ANSWERS = json.loads(r"""{{ cookiecutter | tojson }}""")

SUPPORTED_PYTHONS = ("3.11", "3.12", "3.13")
DATABASES = ("postgres", "none")
YES_NO = ("yes", "no")
PROJECT_SLUG = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")
PACKAGE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
IMAGE_REF = re.compile(r"^[a-z0-9]+([._/:-][a-z0-9]+)*$")
# Names that would shadow the standard library or the service's own dependencies.
RESERVED_PACKAGES = {
    *sys.stdlib_module_names,
    "dramatiq", "redis", "pydantic", "pydantic_settings", "prometheus_client",
    "psycopg", "psycopg_pool", "pulumi", "pulumi_kubernetes", "worker_infra",
    "tests", "test", "src", "infra",
}


def check_project(answers: dict[str, str]) -> str | None:
    project = answers["project"]
    if not PROJECT_SLUG.match(project) or len(project) > 40:
        return (f"project {project!r}: must be a lowercase slug of at most 40 characters "
                "(letters, digits and single dashes, starting with a letter), e.g. orders-worker")
    return None


def check_package(answers: dict[str, str]) -> str | None:
    package = answers["package"]
    if not PACKAGE_NAME.match(package):
        return f"package {package!r}: must be a lowercase Python identifier, e.g. orders_worker"
    if keyword.iskeyword(package) or keyword.issoftkeyword(package):
        return f"package {package!r}: is a Python keyword; choose another project name"
    if package in RESERVED_PACKAGES:
        return (f"package {package!r}: shadows a standard-library or dependency module; "
                "choose another project name")
    return None


def check_choices(answers: dict[str, str]) -> str | None:
    for key, allowed in (("python_version", SUPPORTED_PYTHONS), ("database", DATABASES),
                         ("sandbox_pool", YES_NO)):
        if answers[key] not in allowed:
            return f"{key} {answers[key]!r}: must be one of {', '.join(allowed)}"
    return None


def check_namespace(answers: dict[str, str]) -> str | None:
    namespace = answers["k8s_namespace"]
    if not DNS_LABEL.match(namespace) or len(namespace) > 55:
        return (f"k8s_namespace {namespace!r}: must be a DNS label of at most 55 characters "
                "(the sandbox namespace appends '-sandbox')")
    return None


def check_image(answers: dict[str, str]) -> str | None:
    image = answers["image"]
    if not IMAGE_REF.match(image) or image.endswith(":latest"):
        return f"image {image!r}: must be a lowercase image reference without a tag"
    return None


def check_template_source(answers: dict[str, str]) -> str | None:
    repo, ref = answers["template_repo"], answers["template_ref"]
    if not re.match(r"^(https://|ssh://|git@|file://)\S+$", repo):
        return f"template_repo {repo!r}: must be a git URL (https://, ssh://, git@ or file://)"
    if not re.match(r"^[A-Za-z0-9._/-]+$", ref):
        return f"template_ref {ref!r}: must be a git tag or branch name"
    return None


CHECKS = (check_project, check_package, check_choices, check_namespace, check_image,
          check_template_source)


def problems(answers: dict[str, str]) -> list[str]:
    """Every problem with the answers, one line each."""
    return [problem for check in CHECKS if (problem := check(answers)) is not None]


def main() -> int:
    found = problems(ANSWERS)
    for problem in found:
        print(f"ERROR: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
