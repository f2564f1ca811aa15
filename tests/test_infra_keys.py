"""worker_infra's Redis names (``worker_infra/keys.py``) are the runtime layout's.

The KEDA ``redis`` triggers watch a list by name, and the scaler and the alerts select
the delay queues' series by their suffix: if worker_infra and the worker spelled a key
differently, a pool would scale on a list nobody writes and sit at its floor under load.
worker_infra imports the names from ``worker_runtime.layout.keys``; each rule it applies is
compared with the worker's, for every queue of the default pools.toml and the sandbox's.
worker_infra spells no key anywhere else (the scan below), and the rendered ScaledObjects
of a default bake watch exactly the worker's ready lists.
"""

from __future__ import annotations

import ast
import fnmatch
import tomllib
from pathlib import Path

import pytest
import yaml
from bakery import bake_project, make_manifests
from worker_runtime.layout import keys as LAYOUT_KEYS
from worker_infra import keys as infra_keys


WORKER_INFRA = Path(infra_keys.__file__).parent
@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A default bake (every option on: the sandbox pool's queue is among its queues)."""
    return bake_project(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def queues(project: Path) -> list[str]:
    """The default bake's pools' queues, and a name with every character a queue may have."""
    pools = tomllib.loads((project / "pools.toml").read_text())["pools"]
    return sorted({q for pool in pools.values() for q in pool["queues"]} | {"a_b-c.d"})


def test_the_namespace_and_the_delay_suffix_are_the_workers() -> None:
    assert infra_keys.NAMESPACE == LAYOUT_KEYS.NAMESPACE
    assert infra_keys.DELAY_SUFFIX == LAYOUT_KEYS.DELAY_SUFFIX


def test_each_queues_ready_list_and_delay_queue_are_the_workers(queues: list[str]) -> None:
    assert len(queues) >= 5 and LAYOUT_KEYS.SANDBOX_QUEUE in queues
    for queue in queues:
        namespace = LAYOUT_KEYS.namespace_of(queue)
        assert infra_keys.ready_list(queue) == LAYOUT_KEYS.queue_key(queue)
        assert infra_keys.ready_list(queue).startswith(infra_keys.namespace_glob(namespace)[:-1])
        delayed = LAYOUT_KEYS.delay_queue(queue)
        assert infra_keys.delay_queue(queue) == delayed
        assert infra_keys.is_delay_queue(delayed) and not infra_keys.is_delay_queue(queue)
        assert infra_keys.is_delay_queue(LAYOUT_KEYS.queue_key(delayed))
        held = [
            *vars(LAYOUT_KEYS.QueueKeys.of(queue)).values(),
            LAYOUT_KEYS.acks_key("w", queue),
            LAYOUT_KEYS.acks_key("w", delayed),
            LAYOUT_KEYS.heartbeats_key(namespace),
            LAYOUT_KEYS.epoch_key(namespace),
        ]
        others = {LAYOUT_KEYS.NAMESPACE, LAYOUT_KEYS.SANDBOX_NAMESPACE} - {namespace}
        for key in held:
            assert fnmatch.fnmatchcase(key, infra_keys.namespace_glob(namespace)), key
            assert not any(fnmatch.fnmatchcase(key, infra_keys.namespace_glob(o)) for o in others)


def _names(node: ast.AST) -> set[str]:
    """The names and attribute names ``node`` uses (``namespace``, ``args.broker_namespace``)."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def _spelled(tree: ast.Module) -> list[str]:
    """Strings (docstrings aside) that spell a key: the namespace, the delay suffix, or an
    f-string ``"{namespace}:..."`` (a namespaced key built by hand)."""
    prose = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            if node.value.startswith(infra_keys.NAMESPACE) or infra_keys.DELAY_SUFFIX in node.value:
                found.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, ast.JoinedStr):
            for left, right in zip(node.values, node.values[1:], strict=False):
                if (
                    isinstance(left, ast.FormattedValue)
                    and any("namespace" in name for name in _names(left.value))
                    and isinstance(right, ast.Constant)
                    and str(right.value).startswith(":")
                    and not str(right.value).startswith(": ")  # prose: "<namespace>: ..."
                ):
                    found.append(f"line {node.lineno}: an f-string key on a namespace")
    return found


def test_worker_infra_spells_redis_names_only_in_keys_py() -> None:
    spelled = {
        path.name: found
        for path in sorted(WORKER_INFRA.glob("*.py"))
        if (found := _spelled(ast.parse(path.read_text())))
    }
    assert set(spelled) == {"keys.py"}, (
        f"Redis names spelled outside worker_infra/keys.py: "
        f"{ {k: v for k, v in spelled.items() if k != 'keys.py'} }"
    )


def test_a_default_bakes_scaled_objects_watch_the_workers_ready_lists(
    project: Path, queues: list[str]
) -> None:
    result = make_manifests(project, "dev")
    assert result.returncode == 0, result.stderr
    watched = {}
    for doc in yaml.safe_load_all((project / "build" / "manifests" / "dev.yaml").read_text()):
        if doc and doc.get("kind") == "ScaledObject":
            for trigger in doc["spec"]["triggers"]:
                if trigger["type"] == "redis":
                    watched[trigger["name"]] = trigger["metadata"]["listName"]
    expected = {f"ready-{q}".replace("_", "-"): LAYOUT_KEYS.queue_key(q) for q in queues}
    expected.update({f"ready-{q}-{p}".replace("_", "-"): LAYOUT_KEYS.lane_key(q, p)
                     for q in queues for p in ("high", "low")})
    expected = {name: key for name, key in expected.items() if "a-b-c.d" not in name}
    assert watched == expected
