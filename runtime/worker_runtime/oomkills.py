"""OOM kills in this container, as the kernel counts them in its memory cgroup.

A worker container holds several processes (the supervisor, its worker processes, their
subprocesses). When the container reaches its memory limit the kernel's OOM killer picks
the biggest process, a worker process, not the container: unless the whole cgroup is
killed as a group (cgroup v2 with ``memory.oom.group``, which kubelets set only from
Kubernetes 1.32), the supervisor replaces the process, the container is never
``OOMKilled``, and an alert on kube-state-metrics' ``last_terminated_reason`` stays
silent. The kernel still counts each kill in the cgroup: ``oom_kill`` in
``memory.events`` (v2) or ``memory.oom_control`` (v1). :class:`OomKills` reads it, and
exports how many happened since the supervisor started as ``worker_oom_kills_total``
(:data:`.contract.OOM_KILLS`; the ``WorkerProcessOOMKilled`` alert reads it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from . import contract

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

CGROUP_ROOT = Path("/sys/fs/cgroup")
_OOM_KILL = re.compile(rb"^oom_kill (\d+)$", re.MULTILINE)


def counter_files(proc_cgroup: str, root: Path = CGROUP_ROOT) -> list[Path]:
    """Where this process's cgroup counts its OOM kills, most specific first, given the text
    of ``/proc/self/cgroup``: the v1 memory controller's ``memory.oom_control``, else the
    unified (v2) ``memory.events``, each at the cgroup's path and at the mount's root (a
    container whose cgroup namespace is the host's sees the full path, but its cgroup
    mounted at the root)."""
    found: list[Path] = []
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if "memory" in controllers.split(","):
            found += [root / "memory" / relative / "memory.oom_control"]
            found += [root / "memory" / "memory.oom_control"]
        elif controllers == "":
            found += [root / relative / "memory.events", root / "memory.events"]
    return found


def read_count(path: Path) -> int | None:
    """The ``oom_kill`` count in ``path``; None when it cannot be read or has none."""
    try:
        found = _OOM_KILL.search(path.read_bytes())
    except OSError:
        return None
    return int(found.group(1)) if found else None


class OomKills(Collector):
    """This container's OOM kills since it was made: :attr:`path` (None: none readable, the
    count stays 0), and the count then.

    Parameters:
      path: the counter's file (default: the first of :func:`counter_files` for this
        process that holds one).
    """

    def __init__(self, path: Path | None = None) -> None:
        if path is None:
            try:
                text = Path("/proc/self/cgroup").read_text()
            except OSError:
                text = ""
            path = next((p for p in counter_files(text) if read_count(p) is not None), None)
        self.path = path
        self._base = self._read()

    def _read(self) -> int:
        found = None if self.path is None else read_count(self.path)
        return 0 if found is None else found

    def total(self) -> int:
        """OOM kills in this container since this object was made."""
        return max(0, self._read() - self._base)

    def collect(self) -> Iterable[Metric]:
        counter = CounterMetricFamily(
            contract.OOM_KILLS,
            "Processes of this container the kernel's OOM killer killed since the "
            "supervisor started (its memory cgroup's oom_kill count).",
        )
        counter.add_metric([], self.total())
        return [counter]
