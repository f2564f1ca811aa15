"""The golden path in the portal: template.yaml (Backstage scaffolder v1beta3, fetch:cookiecutter)
asks exactly what cookiecutter.json asks, with the same labels, choices and the hook's
patterns, and passes Backstage's own validator; every bake's catalog-info.yaml is a valid
Component whose links point at the dashboard it ships and at the runbook."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from bakery import TEMPLATE, load_module
from nodetools import check_json

COOKIECUTTER = json.loads((TEMPLATE / "cookiecutter.json").read_text())
PROMPTS = COOKIECUTTER["__prompts__"]
ANSWERS = [key for key in COOKIECUTTER if not key.startswith("_")]
TEMPLATE_YAML = TEMPLATE / "template.yaml"


def generator() -> Any:
    return load_module("backstage_template", TEMPLATE / "scripts" / "backstage_template.py")


def loaded_template() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(TEMPLATE_YAML.read_text())
    return loaded


def form_properties() -> dict[str, dict[str, Any]]:
    return {
        name: prop
        for page in loaded_template()["spec"]["parameters"]
        for name, prop in page["properties"].items()
    }


def test_template_yaml_is_current() -> None:
    assert TEMPLATE_YAML.read_text() == generator().render(), (
        "template.yaml is stale: run python scripts/backstage_template.py --write"
    )


def test_the_form_asks_what_cookiecutter_asks() -> None:
    """Checked against cookiecutter.json and the hook directly, not through the generator."""
    props = form_properties()
    derived = set(generator().FROM_REPOSITORY)
    assert set(props) - {"repoUrl"} == set(ANSWERS) - derived
    patterns = generator().hook_patterns()
    for name in set(ANSWERS) - derived:
        default, prop = COOKIECUTTER[name], props[name]
        assert prop["title"] == PROMPTS[name]
        if isinstance(default, list):
            assert prop["enum"] == default and prop["default"] == default[0]
        elif "{{" not in default:
            assert prop["default"] == default
    for name, (constant, _) in generator().VALIDATION.items():
        assert props[name]["pattern"] == patterns[constant].pattern
    (step,) = [s for s in loaded_template()["spec"]["steps"] if s["action"] == "fetch:cookiecutter"]
    assert step["input"]["values"] == {
        n: generator().FROM_REPOSITORY.get(n, "${{ parameters.%s }}" % n) for n in ANSWERS  # noqa: UP031
    }


def test_owner_and_system_are_picked_from_the_catalog_and_nothing_shows_jinja() -> None:
    """Owner and system come from Backstage's entity pickers, not free text; no field shows
    cookiecutter's raw `{{ cookiecutter.project }}`; the service's repository URL (the
    catalog's source-location) comes from the Repository page's picker."""
    props = form_properties()
    assert props["owner"]["ui:field"] == "OwnerPicker"
    assert props["system"]["ui:field"] == "EntityPicker"
    assert props["system"]["ui:options"]["catalogFilter"] == [{"kind": "System"}]
    for name, prop in props.items():
        assert "{{" not in json.dumps(prop) and "cookiecutter" not in json.dumps(prop), name
    patterns = generator().hook_patterns()
    assert patterns["SYSTEM_REF"].match("system:default/workers")  # what EntityPicker gives
    assert patterns["ENTITY_REF"].match("group:default/orders-team")  # OwnerPicker
    (step,) = [s for s in loaded_template()["spec"]["steps"] if s["action"] == "fetch:cookiecutter"]
    assert "parseRepoUrl" in step["input"]["values"]["repo_url"]


def test_the_readme_says_fetch_cookiecutter_needs_its_module() -> None:
    readme = (TEMPLATE / "README.md").read_text()
    assert "@backstage/plugin-scaffolder-backend-module-cookiecutter" in readme


def page_schema(page: dict[str, Any]) -> dict[str, Any]:
    props = {k: {x: y for x, y in v.items() if not x.startswith("ui:")}
             for k, v in page["properties"].items()}
    return {"type": "object", "required": page["required"], "properties": props}


@pytest.mark.parametrize(
    ("answer", "value"),
    [("project", "Orders Worker"), ("project", "x" * 41), ("k8s_namespace", "Prod_NS"),
     ("image", "Registry.example.com/Foo"), ("template_repo", "not a url"),
     ("python_version", "3.10"), ("owner", "team with spaces"), ("grafana_url", "grafana")],
)
def test_the_form_refuses_what_the_hook_refuses(answer: str, value: str) -> None:
    (page,) = [p for p in loaded_template()["spec"]["parameters"] if answer in p["properties"]]
    schema = page_schema(page)
    defaults = {k: v["default"] for k, v in page["properties"].items() if "default" in v}
    jsonschema.validate(defaults, schema)  # the defaults pass
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**defaults, answer: value}, schema)


@pytest.mark.usefixtures("node_tools")
def test_template_yaml_passes_backstages_validator(tmp_path: Path) -> None:
    result = check_json("template", loaded_template(), tmp_path)
    assert result["ok"], result["problems"]
    broken = loaded_template()
    del broken["spec"]["steps"]
    assert not check_json("template", broken, tmp_path)["ok"], "the validator accepts anything"


COMBINATIONS = [
    {"database": database, "sandbox_pool": sandbox}
    for database, sandbox in itertools.product(["postgres", "none"], ["yes", "no"])
] + [{"project": "a-very-long-project-name-for-lint-checks", "owner": "team-a",
      "system": "billing", "grafana_url": "https://grafana.acme.io/"}]


@pytest.mark.usefixtures("node_tools")
@pytest.mark.parametrize("options", COMBINATIONS, ids=lambda o: "-".join(o.values())[:40])
def test_catalog_info_is_a_valid_component_linking_dashboard_and_runbook(
    bake: Callable[..., Path], options: dict[str, str], tmp_path: Path
) -> None:
    project = bake(**options)
    documents = list(yaml.safe_load_all((project / "catalog-info.yaml").read_text()))
    (entity,) = documents
    result = check_json("entity", entity, tmp_path)
    assert result["ok"], result["problems"]
    assert entity["kind"] == "Component" and entity["metadata"]["name"] == project.name
    assert entity["spec"]["owner"] == options.get("owner", COOKIECUTTER["owner"])
    assert entity["spec"]["system"] == options.get("system", COOKIECUTTER["system"])
    links = {link["type"]: link["url"] for link in entity["metadata"]["links"]}
    dashboard = json.loads((project / "ops" / "dashboard.json").read_text())
    assert links["dashboard"].endswith(f"/d/{dashboard['uid']}")
    assert "//d/" not in links["dashboard"]
    runbook = re.fullmatch(r".+/blob/[^/]+/(.+)", links["runbook"])
    assert runbook and (TEMPLATE / runbook.group(1)).is_file(), links["runbook"]
    # Day one: experimental; TechDocs from the bake's own mkdocs.yml and docs/; its source.
    assert entity["spec"]["lifecycle"] == "experimental"
    annotations = entity["metadata"]["annotations"]
    assert annotations["backstage.io/techdocs-ref"] == "dir:."
    mkdocs = yaml.safe_load((project / "mkdocs.yml").read_text())
    assert all((project / "docs" / page).is_file()
               for item in mkdocs["nav"] for page in item.values())
    assert annotations["backstage.io/source-location"] == (
        f"url:https://github.com/example-org/{project.name}/"
    )


@pytest.mark.usefixtures("node_tools")
def test_the_entity_validator_refuses_a_broken_component(tmp_path: Path) -> None:
    entity = {"apiVersion": "backstage.io/v1alpha1", "kind": "Component",
              "metadata": {"name": "x y"}, "spec": {"type": "service", "owner": "a"}}
    result = check_json("entity", entity, tmp_path)
    assert not result["ok"] and len(result["problems"]) >= 2
