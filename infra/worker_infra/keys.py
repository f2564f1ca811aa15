"""The Redis names worker_infra reads: the one module of the package that spells them.

The worker's Redis layout is the baked service's (``src/<package>/layout/keys.py``); the
infrastructure needs three of its rules, spelled here and nowhere else in worker_infra:

* a queue ``q``'s ready list is ``<namespace>:q`` (:func:`ready_list`): the list each
  KEDA ``redis`` trigger watches; the namespace is the pool's ``broker_namespace``, which
  the service's pool model computes (``dramatiq``, ``dramatiq-sandbox`` for the sandbox);
* a queue's delay queue is ``q.DQ`` (:func:`delay_queue`): the exporter's ``queue`` label
  of delayed messages, which the scaler's age query and the alerts select;
* every key of a broker namespace starts with ``<namespace>:`` (:func:`namespace_glob`):
  the sandbox pool's Redis ACL user may touch those keys only;
* :data:`NAMESPACE`, the namespace of every pool but the sandbox's (whose Redis ACL user
  must not share it).

The template's ``tests/test_infra_keys.py`` checks each rule here against the baked
layout's own (both modules loaded side by side): a change in either spelling fails it.
"""

from __future__ import annotations

from typing import Final

#: Dramatiq's key prefix of every queue but the sandbox's (layout's ``NAMESPACE``).
NAMESPACE: Final = "dramatiq"
#: Suffix of a queue's delay queue (layout's ``DELAY_SUFFIX``, Dramatiq's ``dq_name``).
DELAY_SUFFIX: Final = ".DQ"


def ready_list(namespace: str, queue: str) -> str:
    """The Redis list of ``queue``'s messages ready to run, in broker ``namespace``."""
    return f"{namespace}:{queue}"


def delay_queue(queue: str) -> str:
    """The name of ``queue``'s delay queue (``q.DQ``): its ``queue`` label in the metrics."""
    return queue + DELAY_SUFFIX


def is_delay_queue(name: str) -> bool:
    """True when ``name`` (a queue name, or a list of one) is a delay queue's."""
    return name.endswith(DELAY_SUFFIX)


def namespace_glob(namespace: str) -> str:
    """A glob matching every key of broker ``namespace`` (and no other namespace's)."""
    return f"{namespace}:*"
