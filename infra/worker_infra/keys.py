"""The Redis names worker_infra reads, from their one owner: the runtime's layout
(``worker_runtime.layout.keys``). Nothing here spells a key; the rules are the worker's:

* a queue ``q``'s ready list (:func:`ready_list`, the layout's ``queue_key``) and its
  priority lanes' lists (:func:`priority_lists`): the lists the KEDA ``redis`` triggers
  watch, in the namespace the layout gives the queue (``dramatiq``, ``dramatiq-sandbox``
  for the sandbox's queue, the pool's ``broker_namespace``);
* a queue's delay queue ``q.DQ`` (:func:`delay_queue`): the exporter's ``queue`` label of
  delayed messages, which the scaler's age query and the alerts select;
* every key of a broker namespace starts with ``<namespace>:`` (:func:`namespace_glob`):
  the sandbox pool's Redis ACL user may touch those keys only;
* :data:`NAMESPACE`, the namespace of every pool but the sandbox's (whose Redis ACL user
  must not share it).
"""

from __future__ import annotations

from worker_runtime.layout.keys import (
    DEFAULT_PRIORITY,
    DELAY_SUFFIX,
    NAMESPACE,
    PRIORITIES,
    delay_queue,
    lane_key,
)
from worker_runtime.layout.keys import queue_key as ready_list

__all__ = [
    "DELAY_SUFFIX",
    "NAMESPACE",
    "delay_queue",
    "is_delay_queue",
    "namespace_glob",
    "priority_lists",
    "ready_list",
]


def priority_lists(queue: str) -> dict[str, str]:
    """The lists of ``queue``'s other priority lanes (``high``, ``low``), by priority: a
    message sent with a priority waits there, not on :func:`ready_list`."""
    return {p: lane_key(queue, p) for p in PRIORITIES if p != DEFAULT_PRIORITY}


def is_delay_queue(name: str) -> bool:
    """True when ``name`` (a queue name, or a list of one) is a delay queue's."""
    return name.endswith(DELAY_SUFFIX)


def namespace_glob(namespace: str) -> str:
    """A glob matching every key of broker ``namespace`` (and no other namespace's)."""
    return f"{namespace}:*"
