"""The service the runtime runs: one description, handed over by the bake.

A bake's ``src/<package>/__init__.py`` says::

    SERVICE = worker_runtime.Service(package=__name__, project="orders-worker", version="1.4.0")

Constructing it makes it the process's service (:func:`current`): every process of the
service imports its package first (``python -m <package> ...``, a producer importing an
actor), so the runtime always knows whose actors, broker, settings and pools.toml it runs.
The runtime loads the service's modules by name (``<package>.broker``, ``<package>.actors``,
``<package>.settings``), never by file path.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

#: The service's modules the runtime loads by name (``<package>.<module>``).
BROKER_MODULE = "broker"
ACTORS_PACKAGE = "actors"
SETTINGS_MODULE = "settings"


@dataclass(frozen=True)
class Service:
    """A worker service built on the runtime.

    Parameters:
      package: its import name (``orders_worker``): ``python -m <package>`` runs its CLI.
      project: its distribution and command name (``orders-worker``): the console script,
        the default ``OTEL_SERVICE_NAME``, its state folder ``/tmp/<project>``.
      version: its own version, in its start and stop lines and its telemetry.
      description: one line about it (the CLI's help).
      home: the service's project folder, where its pools.toml is (default: two folders up
        from the package, the ``src/<package>`` layout of a bake).
    """

    package: str
    project: str
    version: str
    description: str = ""
    home: Path | None = None

    def __post_init__(self) -> None:
        use(self)

    def module(self, name: str) -> ModuleType:
        """The service's module ``<package>.<name>``, imported."""
        return importlib.import_module(f"{self.package}.{name}")

    def has_module(self, name: str) -> bool:
        """True when the service has a module ``<package>.<name>``."""
        return importlib.util.find_spec(f"{self.package}.{name}") is not None

    @property
    def directory(self) -> Path:
        """The folder of the service's package (``src/<package>``)."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"service package {self.package!r} cannot be found")
        return Path(next(iter(spec.submodule_search_locations))).resolve()

    @property
    def root(self) -> Path:
        """The service's project folder (:attr:`home`), where its pools.toml is."""
        return self.home if self.home is not None else self.directory.parents[1]

    @property
    def actors_package(self) -> str:
        return f"{self.package}.{ACTORS_PACKAGE}"

    def broker(self) -> Any:
        """The service's broker (``<package>.broker.broker``): importing it builds it."""
        return self.module(BROKER_MODULE).broker

    def settings_class(self) -> type[Any] | None:
        """The service's settings class (``<package>.settings.Settings``: the runtime's
        :class:`~worker_runtime.settings.WorkerSettings` and the team's own variables), or None
        when the service has no settings module (the runtime's are used)."""
        if not self.has_module(SETTINGS_MODULE):
            return None
        found: type[Any] = self.module(SETTINGS_MODULE).Settings
        return found


_current: Service | None = None


def use(service: Service) -> None:
    """Make ``service`` the process's service (constructing one does)."""
    global _current
    _current = service


def current() -> Service:
    """The process's service: the last :class:`Service` constructed (its package's
    ``__init__`` constructs it). Raises RuntimeError when no service package was imported."""
    if _current is None:
        raise RuntimeError(
            "no worker service: import the service's package (it constructs its "
            "worker_runtime.Service) before using the runtime"
        )
    return _current


def runtime_version() -> str:
    """worker-runtime's installed version (``0+unknown`` from a checkout not installed)."""
    try:
        return metadata.version("worker-runtime")
    except metadata.PackageNotFoundError:
        return "0+unknown"
