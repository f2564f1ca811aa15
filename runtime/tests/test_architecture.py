"""docs/architecture.md's maintainer tasks, checked against the code.

The doc says how many files "add a pool option", "add a metric", "change how retries back
off", "add a Redis key" and "change the drain" touch and names them. These tests read the
code (its syntax trees) and fail when a pool field's bound or default is copied outside
``pools.py``, when a metric is defined or recorded outside the files named, when the retry
backoff is stated or the retry copy built outside the files named (or an actor's own
options), when a Redis key is spelled outside ``layout/keys.py``, when the drain reaches
outside the files named or keeps an unnamed constant, or when the doc's list or count is
wrong.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, get_origin

from worker_runtime import pools
from worker_runtime import worker as runtime
from worker_runtime.pools import Pool, pool_env_fields

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "worker_runtime"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
#: Keywords of a pydantic ``Field`` (or annotated-types) that state a bound.
BOUND_KEYWORDS = frozenset({"ge", "gt", "le", "lt", "min_length", "max_length", "multiple_of"})
#: prometheus_client's metric classes: their first argument is the metric's name.
METRIC_CLASSES = frozenset(
    {
        "Counter",
        "Gauge",
        "Histogram",
        "Summary",
        "Info",
        "Enum",
        "CounterMetricFamily",
        "GaugeMetricFamily",
        "HistogramMetricFamily",
        "SummaryMetricFamily",
    }
)
#: Numbers the drain may spell: nothing, one, and the ms-to-s factor.
PLAIN_NUMBERS = frozenset({0, 1, 1000})


@dataclass(frozen=True)
class Task:
    """A row of the doc's table of maintainer tasks.

    Parameters:
      most: the most files the row says the task touches.
      files: the package's files the row names (paths relative to ``src/<package>``).
    """

    most: int
    files: frozenset[str]


def task(name: str) -> Task:
    """The row of task ``name`` in docs/architecture.md's "Maintainer tasks" table."""
    section = ARCHITECTURE.read_text().split("## Maintainer tasks", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] == name:
            bound = re.search(r"at most (\d+)", cells[1]) or re.search(r"(\d+)", cells[1])
            assert bound, f"task {name!r}: no number of files in {cells[1]!r}"
            named = re.findall(r"`([^`]+)`", cells[2])
            return Task(int(bound.group(1)), frozenset(t for t in named if _in_package(t)))
    raise AssertionError(f"docs/architecture.md has no row for the task {name!r}")


def _in_package(token: str) -> bool:
    return token.endswith(".py") and (PACKAGE / token).is_file()


def modules() -> dict[str, ast.Module]:
    """Every module of the package, parsed, by its path relative to ``src/<package>``."""
    return {
        path.relative_to(PACKAGE).as_posix(): ast.parse(path.read_text(), str(path))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


# -- add a pool option ----------------------------------------------------------------


def class_fields(tree: ast.Module) -> Iterator[tuple[str, ast.AnnAssign]]:
    """(name, statement) of every field declared in a class body (models, dataclasses)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                    yield statement.target.id, statement


def states_bound_or_default(field: ast.AnnAssign) -> bool:
    """True when a field declaration spells a bound or a default (None is "unset")."""
    value = field.value
    if value is not None and not (isinstance(value, ast.Constant) and value.value is None):
        return True
    return any(
        isinstance(node, ast.keyword) and node.arg in BOUND_KEYWORDS
        for node in ast.walk(field.annotation)
    )


def annotation_names(field: ast.AnnAssign) -> set[str]:
    """The names a field's annotation uses (also inside a quoted annotation)."""
    annotation = field.annotation
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    return {node.id for node in ast.walk(annotation) if isinstance(node, ast.Name)}


def pool_bound_types() -> set[str]:
    """The bounded types ``pools.py`` states once (``Concurrency``, ``Processes``, ...)."""
    return {name for name, value in vars(pools).items() if get_origin(value) is Annotated}


def pool_names() -> set[str]:
    """A pool field's names: the field, and the settings field of an ``env:`` field."""
    return set(Pool.model_fields) | {var.lower() for var in pool_env_fields().values()}


def test_a_pool_fields_bound_and_default_are_stated_only_in_pools_py() -> None:
    copies = [
        f"{path}:{field.lineno}: {name}"
        for path, tree in modules().items()
        if path != "pools.py"
        for name, field in class_fields(tree)
        if name in pool_names() and states_bound_or_default(field)
    ]
    assert copies == [], (
        "a pool field's bound or default is stated again (use its type from pools.py and "
        f"take the default from the pool): {copies}"
    )


def test_adding_a_pool_option_touches_the_files_the_doc_names() -> None:
    row = task("add a pool option")
    settings_names = {var.lower() for var in pool_env_fields().values()}
    bound_types = pool_bound_types()
    stating = {
        path
        for path, tree in modules().items()
        for name, field in class_fields(tree)
        if name in settings_names
        or (name in Pool.model_fields and annotation_names(field) & bound_types)
    }
    assert "pools.py" in stating
    assert stating == row.files, (
        f"the files that declare a pool field are {sorted(stating)}, "
        f"docs/architecture.md names {sorted(row.files)}"
    )
    assert len(row.files) + 1 <= row.most, "the declaring files and the one that reads it"


# -- add a metric -----------------------------------------------------------------------


def metric_definitions(tree: ast.Module) -> Iterator[str]:
    """The name of every metric a module creates (the first argument of a metric class)."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        first = node.args[0]
        if called in METRIC_CLASSES and isinstance(first, ast.Constant):
            yield str(first.value)


def metric_factories(tree: ast.Module) -> set[str]:
    """Module-level functions that create metrics (``instruments()``)."""
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and any(metric_definitions(ast.Module([node], [])))
    }


def calls(tree: ast.Module) -> set[str]:
    return {
        node.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }


def test_adding_a_metric_touches_the_one_file_the_doc_names() -> None:
    row = task("add a metric")
    parsed = modules()
    defined: dict[str, set[str]] = {}
    for path, tree in parsed.items():
        for name in metric_definitions(tree):
            defined.setdefault(name, set()).add(path)
    assert defined, "no metric found: the scan no longer sees how metrics are created"
    spread = {name: sorted(paths) for name, paths in defined.items() if len(paths) > 1}
    assert spread == {}, f"metrics defined in more than one file: {spread}"
    assert 1 <= row.most <= 2, "the file that defines and records it, and a layout module"
    unnamed = {name: sorted(paths - row.files) for name, paths in defined.items()}
    assert {n: p for n, p in unnamed.items() if p} == {}, (
        "metrics defined in files docs/architecture.md does not name for 'add a metric'"
    )
    recorded_elsewhere = [
        f"{other}: {factory}()"
        for path in {p for paths in defined.values() for p in paths}
        for factory in metric_factories(parsed[path])
        for other, tree in parsed.items()
        if other != path and factory in calls(tree)
    ]
    assert recorded_elsewhere == [], "a metric is recorded outside the file that defines it"


# -- change how retries back off ---------------------------------------------------------

#: The retry backoff's names: Retries' parameters and attributes, the actor options.
BACKOFF_NAMES = frozenset({"min_backoff", "max_backoff"})
#: Dramatiq's backoff function: the consumer also uses it to space its polls of an empty
#: queue (its ``max_backoff`` keyword there is the poll's, not a retry's).
BACKOFF_FUNCTION = "compute_backoff"
#: Where actors are declared, each with its own options.
ACTORS = "actors/"


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def backoff_mentions(tree: ast.Module) -> list[int]:
    """Lines of ``tree`` that state a retry backoff: a backoff name as a parameter, an
    attribute, a keyword (but to :data:`BACKOFF_FUNCTION`) or a string (an actor option)."""
    polls = {
        id(keyword)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _call_name(node) == BACKOFF_FUNCTION
        for keyword in node.keywords
    }
    return [
        node.lineno
        for node in ast.walk(tree)
        if (isinstance(node, ast.arg) and node.arg in BACKOFF_NAMES)
        or (isinstance(node, ast.Attribute) and node.attr in BACKOFF_NAMES)
        or (isinstance(node, ast.keyword) and node.arg in BACKOFF_NAMES and id(node) not in polls)
        or (isinstance(node, ast.Constant) and node.value in BACKOFF_NAMES)
    ]


def retry_copies(tree: ast.Module) -> list[int]:
    """Lines of ``tree`` that build a retry settlement (``Settlement("retry", ...)``)."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and _call_name(node) == "Settlement"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "retry"
    ]


def test_changing_the_backoff_touches_the_files_the_doc_names() -> None:
    row = task("change how retries back off")
    parsed = modules()
    stated = {
        path
        for path, tree in parsed.items()
        if backoff_mentions(tree) and not path.startswith(ACTORS)  # an actor's own options
    }
    built = {path for path, tree in parsed.items() if retry_copies(tree)}
    constructed = {
        path
        for path, tree in parsed.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _call_name(node) == "CrashAwareRetries"
    }
    assert constructed == {"middleware/__init__.py"}, (
        f"CrashAwareRetries is built in {sorted(constructed)}"
    )
    assert built == {"middleware/retries.py"}, f"retry copies are built in {sorted(built)}"
    assert {"middleware/__init__.py", "middleware/retries.py"} <= row.files and len(
        row.files
    ) <= row.most
    assert stated <= row.files, (
        f"the retry backoff is stated in {sorted(stated - row.files)}, which "
        "docs/architecture.md does not name for 'change how retries back off'"
    )


# -- add a Redis key ----------------------------------------------------------------------

#: What a string holding a Redis key starts with (the namespaces) or contains (Dramatiq's
#: key parts); ``layout/keys.py`` builds every key.
KEYS_MODULE = "layout/keys.py"
KEY_STARTS = ("dramatiq:", "dramatiq-sandbox:")
KEY_PARTS = ("__acks__", "__heartbeats__")
KEY_SUFFIXES = (".DQ", ".XQ", ".msgs")
NAMESPACE_NAMES = frozenset({"NAMESPACE", "SANDBOX_NAMESPACE"})


def _docstrings(tree: ast.Module) -> set[int]:
    """Ids of the docstring constants of ``tree`` (prose may name keys)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _names(node: ast.AST) -> set[str]:
    """The names and attribute names ``node`` uses (``NAMESPACE``, ``layout.NAMESPACE``)."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def spelled_keys(tree: ast.Module) -> list[str]:
    """What ``tree`` spells of a Redis key: strings that start with a namespace, hold a
    Dramatiq key part or are a key suffix, and f-strings ``f"{NAMESPACE}:..."``."""
    prose = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            text = node.value
            if (
                text.startswith(KEY_STARTS)
                or any(part in text for part in KEY_PARTS)
                or text in KEY_SUFFIXES
            ):
                found.append(f"line {node.lineno}: {text!r}")
        elif isinstance(node, ast.JoinedStr):
            for value, after in itertools.pairwise(node.values):
                if (
                    isinstance(value, ast.FormattedValue)
                    and _names(value.value) & NAMESPACE_NAMES
                    and isinstance(after, ast.Constant)
                    and str(after.value).startswith(":")
                ):
                    found.append(f"line {node.lineno}: an f-string key on the namespace")
    return found


def test_adding_a_redis_key_touches_the_files_the_doc_names() -> None:
    row = task("add a Redis key")
    parsed = modules()
    assert spelled_keys(parsed[KEYS_MODULE]), f"the scan no longer sees {KEYS_MODULE}'s keys"
    assert KEYS_MODULE in row.files, f"the row names {sorted(row.files)}, not {KEYS_MODULE}"
    assert all(path.startswith("layout/") for path in row.files), "only layout's modules"
    assert row.most <= 3, "the builder, the script of its concept, the module that uses it"
    elsewhere = {
        path: spelled
        for path, tree in parsed.items()
        if path != KEYS_MODULE and (spelled := spelled_keys(tree))
    }
    assert elsewhere == {}, f"Redis keys spelled outside {KEYS_MODULE}: {elsewhere}"


# -- change the drain -------------------------------------------------------------------


def drain_code() -> list[ast.AST]:
    """``WorkerProcess.drain`` and every function of worker.py it calls, transitively."""
    tree = modules()["worker.py"]
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    (process,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "WorkerProcess")
    methods = {node.name: node for node in process.body if isinstance(node, ast.FunctionDef)}
    assert "drain" in methods, "worker.py's WorkerProcess has no drain()"
    found: dict[str, ast.AST] = {}
    pending = ["self.drain"]
    while pending:
        name = pending.pop()
        if name in found:
            continue
        node = methods[name[5:]] if name.startswith("self.") else functions[name]
        found[name] = node
        for call in ast.walk(node):
            if not isinstance(call, ast.Call):
                continue
            func = call.func
            if isinstance(func, ast.Name) and func.id in functions:
                pending.append(func.id)
            elif (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id == "self"
                and func.attr in methods
            ):
                pending.append(f"self.{func.attr}")
    return list(found.values())


def _round_digits(nodes: list[ast.AST]) -> set[int]:
    """Ids of the ``ndigits`` arguments of ``round()`` calls (a precision, not a constant)."""
    return {
        id(node.args[1])
        for code in nodes
        for node in ast.walk(code)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "round"
        and len(node.args) == 2
    }


def test_the_drain_names_its_constants() -> None:
    code = drain_code()
    digits = _round_digits(code)
    unnamed = sorted(
        {
            node.value
            for part in code
            for node in ast.walk(part)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, int | float)
            and not isinstance(node.value, bool)
            and node.value not in PLAIN_NUMBERS
            and id(node) not in digits
        }
    )
    assert unnamed == [], f"the drain spells numbers instead of named constants: {unnamed}"


def _is_shared_state(value: Any) -> bool:
    """True for a module global that holds state (an object other than code or a constant)."""
    if inspect.ismodule(value) or inspect.isclass(value) or callable(value):
        return False
    return not isinstance(value, int | float | str | bytes | logging.Logger | type(None))


def test_the_drain_is_given_its_collaborators() -> None:
    globals_used = {
        node.id
        for part in drain_code()
        for node in ast.walk(part)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
    } & set(vars(runtime))
    shared = sorted(name for name in globals_used if _is_shared_state(getattr(runtime, name)))
    assert shared == [], f"the drain reaches module globals instead of its parameters: {shared}"


def test_changing_the_drain_touches_the_files_the_doc_names() -> None:
    row = task("change the drain")
    code = drain_code()
    worker_internals = {
        node.attr
        for part in code
        for node in ast.walk(part)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "worker"
    }
    collaborators = {
        node.attr
        for part in code
        for node in ast.walk(part)
        if isinstance(node, ast.Attribute)
        and (
            (isinstance(node.value, ast.Name) and node.value.id in {"shutdown", "lifecycle"})
            or (
                isinstance(node.value, ast.Attribute)
                and node.value.attr in {"shutdown", "lifecycle"}
            )
        )
    }
    assert worker_internals and collaborators, "the scan no longer sees the drain's calls"
    names = worker_internals | collaborators

    def reaches(node: ast.AST) -> bool:
        """An access to a collaborator's member, or to the Dramatiq worker's own (read on
        a ``worker``: a queue's ``consumers`` in ``status`` is not the worker's)."""
        if isinstance(node, ast.FunctionDef):
            return node.name in names
        if not isinstance(node, ast.Attribute):
            return False
        value = node.value
        on_worker = (isinstance(value, ast.Name) and value.id == "worker") or (
            isinstance(value, ast.Attribute) and value.attr == "worker"
        )
        return node.attr in collaborators or (node.attr in worker_internals and on_worker)

    reaching = {
        path for path, tree in modules().items() for node in ast.walk(tree) if reaches(node)
    }
    assert "worker.py" in reaching and "worker.py" in row.files
    assert reaching <= row.files, (
        f"the drain's internals and collaborators are used in {sorted(reaching)}, "
        f"docs/architecture.md names {sorted(row.files)}"
    )
    assert len(row.files) <= row.most
