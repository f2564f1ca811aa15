"""Offline rendering: run a Pulumi program under Pulumi's mocks and collect its objects.

No Pulumi CLI, plugin or cluster is needed. Every ``kubernetes:*`` resource the program
registers becomes one manifest (``apiVersion``, ``kind``, ``metadata``, ...), numbers that
arrive as floats become integers again, and Secret values are masked.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulumi
import yaml

from . import preflight

SECRET_PLACEHOLDER = "offline-render-placeholder"
MASK = "<secret>"
_SECRET_SIG = "4dabf18193072939515e22adb298388d"
KIND_ORDER = (
    "Namespace",
    "RuntimeClass",
    "PriorityClass",
    "ServiceAccount",
    "Secret",
    "ConfigMap",
    "ResourceQuota",
    "LimitRange",
    "NetworkPolicy",
    "Deployment",
    "PodDisruptionBudget",
    "TriggerAuthentication",
    "ScaledObject",
    "PodMonitor",
)


class RecordingMocks(pulumi.runtime.Mocks):
    """Mocks that record every registered resource and echo its inputs as its state."""

    def __init__(self) -> None:
        self.resources: list[tuple[str, str, dict[str, Any]]] = []

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict[str, Any]]:
        self.resources.append((args.typ, args.name, dict(args.inputs)))
        return f"{args.name}-id", dict(args.inputs)

    def call(self, args: pulumi.runtime.MockCallArgs) -> tuple[dict[str, Any], None]:
        return {}, None


def plain(value: Any) -> Any:
    """``value`` with secret wrappers removed and integral floats turned into ints."""
    if isinstance(value, dict):
        if value.get(_SECRET_SIG) is not None and "value" in value:
            return plain(value["value"])
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def manifest(typ: str, inputs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The Kubernetes object of a registered resource; None for anything else.

    ``typ`` is e.g. ``kubernetes:apps/v1:Deployment`` or ``kubernetes:keda.sh/v1alpha1:ScaledObject``.
    """
    parts = typ.split(":")
    if len(parts) != 3 or parts[0] != "kubernetes":
        return None
    group_version, kind = parts[1], parts[2]
    api_version = group_version.removeprefix("core/")
    body = _sorted(plain(dict(inputs)))
    obj: dict[str, Any] = {
        "apiVersion": body.pop("apiVersion", api_version),
        "kind": body.pop("kind", kind),
    }
    obj["metadata"] = body.pop("metadata", {})
    obj.update(body)
    if obj["kind"] == "Secret":
        for key in ("data", "stringData"):
            if key in obj:
                obj[key] = {k: MASK for k in obj[key]}
    return obj


def sort_key(obj: Mapping[str, Any]) -> tuple[int, str, str]:
    kind = obj["kind"]
    order = KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)
    meta = obj.get("metadata", {})
    return order, meta.get("namespace", ""), meta.get("name", "")


@contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _ClosingPolicy(asyncio.DefaultEventLoopPolicy):
    """The default policy, remembering each event loop it makes (to close them)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[asyncio.AbstractEventLoop] = []

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        loop = super().new_event_loop()
        self.made.append(loop)
        return loop


def render(
    program: Callable[[], object],
    *,
    project: str,
    stack: str,
    config: Mapping[str, Any] | None = None,
    secret_keys: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Run ``program`` under mocks; return its Kubernetes objects in a stable order.

    Parameters:
      program: creates the resources (e.g. runs the stack's ``__main__.py``).
      project, stack: Pulumi project and stack names.
      config: full keys (``"<project>:<key>"``) to values; non-strings are passed as JSON.
      secret_keys: config keys that are secrets.
    Exceptions the program raises (e.g. a ``GuardError``) propagate unchanged. The
    preflight reads :data:`.preflight.OFFLINE` (nothing live) unless a test installed a
    view of its own (:func:`.preflight.using`).
    """
    env = {
        "PULUMI_CONFIG": json.dumps(
            {k: v if isinstance(v, str) else json.dumps(v) for k, v in (config or {}).items()}
        ),
        "PULUMI_CONFIG_SECRET_KEYS": json.dumps(list(secret_keys)),
    }
    mocks = RecordingMocks()

    def run() -> None:
        program()

    # Pulumi's mocks register each resource in a thread of the loop's default executor, and
    # each of those threads makes an event loop it never closes: garbage in reference cycles,
    # which the collector may finalize socket first (a "ValueError: Invalid file descriptor:
    # -1" traceback on stderr, in 12 of 30 refused renders). Every loop made while the program
    # runs is ours to close once its executor is joined.
    policy = _ClosingPolicy()
    before = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(policy)
    loop = policy.new_event_loop()
    policy.set_event_loop(loop)
    try:
        with _environ(env), preflight.using(preflight.current() or preflight.OFFLINE):
            pulumi.runtime.set_mocks(mocks, project=project, stack=stack, preview=False)
            pulumi.runtime.test(run)()  # type: ignore[no-untyped-call]
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        policy.set_event_loop(None)
        for made in policy.made:
            made.close()
        asyncio.set_event_loop_policy(before)
    objects = [m for typ, _, inputs in mocks.resources if (m := manifest(typ, inputs))]
    return sorted(objects, key=sort_key)


@dataclass(frozen=True)
class StackFiles:
    """A Pulumi project's name and one stack's config, as :func:`render` wants them."""

    project: str
    stack: str
    config: dict[str, Any]
    secret_keys: tuple[str, ...]


def read_stack(infra_dir: Path, stack: str, secrets: Sequence[str] = ()) -> StackFiles:
    """Read ``Pulumi.yaml`` and ``Pulumi.<stack>.yaml`` from ``infra_dir``.

    ``secure:`` values cannot be decrypted offline: they become :data:`SECRET_PLACEHOLDER`
    and their keys are marked secret. Keys without a namespace get the project's.

    Parameters:
      secrets: keys the program requires as secrets (e.g. ``redisPassword``). They are
        set with ``pulumi config set --secret`` before the first ``pulumi up``, so a stack
        file in the repository may lack them: offline they render as the placeholder.
    """
    project_file = yaml.safe_load((infra_dir / "Pulumi.yaml").read_text(encoding="utf-8"))
    project = str(project_file["name"])
    path = infra_dir / f"Pulumi.{stack}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no stack {stack!r}: {path} does not exist")
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    config: dict[str, Any] = {}
    found: list[str] = []
    for key, value in (data.get("config") or {}).items():
        full = key if ":" in key else f"{project}:{key}"
        if isinstance(value, dict) and set(value) == {"secure"}:
            config[full] = SECRET_PLACEHOLDER
            found.append(full)
        else:
            config[full] = value
    for key in secrets:
        full = key if ":" in key else f"{project}:{key}"
        if full not in config:
            config[full] = SECRET_PLACEHOLDER
            found.append(full)
    return StackFiles(project, stack, config, tuple(found))


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the pools file) as literal blocks, readable in a review."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value and not value.startswith(" ") else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(objects: Sequence[Mapping[str, Any]]) -> str:
    """One YAML document per object."""
    text: str = yaml.dump_all(
        [dict(o) for o in objects],
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        width=100,
    )
    return text
