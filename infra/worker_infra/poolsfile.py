"""The stack-merged, validated pools file, mounted into every pod from a ConfigMap.

The worker reads its pool's shape from this file (``WORKER_POOLS_FILE``), so what the
guards checked is what runs.

Each pool's pods read their own file (``ServiceSpec.pool_files``: the pool's entry in full,
the other pools' queues) from a ConfigMap of their own, the scheduler the whole file from
another, so a change to one pool's numbers rolls that pool's Deployment alone.

Each ConfigMap is immutable and named by its content (``<project>-<pool>-pools-<sha256[:10]>``
for a pool, ``<project>-pools-<sha256[:10]>`` for the whole file, :func:`config_map_name`):
a changed file is a new ConfigMap and a new pod template, never an edit under the pods' feet. During a rollout each ReplicaSet's pods read their own file
(an old pod that restarts reads the file it was validated with, not one its pool model may
refuse); Pulumi creates the new ConfigMap before the Deployments move to it and deletes
the old one only after they did (create-before-delete: the name changed), by which time
the old pods are gone or terminating with the file already mounted. A rollback is a
``pulumi up`` of the previous revision: the same content gives the same name, the old pod
template comes back and the Deployment scales its old ReplicaSet up again.
"""

from __future__ import annotations

import hashlib

import pulumi
import pulumi_kubernetes as k8s

#: Key of the file in the ConfigMap, and its name in the mounted directory.
POOLS_KEY = "pools.toml"
#: Directory the ConfigMap is mounted at (read-only).
POOLS_MOUNT = "/etc/worker-pools"
#: ``WORKER_POOLS_FILE`` in every pod.
POOLS_FILE = f"{POOLS_MOUNT}/{POOLS_KEY}"
#: Pod-template annotation holding the file's SHA-256.
CHECKSUM_ANNOTATION = "worker-template/pools-sha256"


#: Hex digits of the file's SHA-256 in the ConfigMap's name.
NAME_DIGITS = 10


def checksum(text: str) -> str:
    """SHA-256 (hex) of the pools file's text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def config_map_name(project: str, text: str, pool_slug: str | None = None) -> str:
    """The ConfigMap's name for the file ``text``: ``<project>-pools-<sha256[:10]>``, or
    ``<project>-<pool_slug>-pools-<sha256[:10]>`` for the file of one pool's pods."""
    prefix = project if pool_slug is None else f"{project}-{pool_slug}"
    return f"{prefix}-pools-{checksum(text)[:NAME_DIGITS]}"


def pools_config_map(
    name: str,
    config_map_name: str,
    namespace: pulumi.Input[str],
    text: str,
    labels: dict[str, str],
    opts: pulumi.ResourceOptions,
) -> k8s.core.v1.ConfigMap:
    """An immutable ConfigMap ``config_map_name`` (see :func:`config_map_name`) holding
    ``text`` under :data:`POOLS_KEY`: a changed file is a new ConfigMap, created before
    the old one is deleted."""
    return k8s.core.v1.ConfigMap(
        name,
        metadata=k8s.meta.v1.ObjectMetaArgs(
            name=config_map_name, namespace=namespace, labels=labels
        ),
        data={POOLS_KEY: text},
        immutable=True,
        opts=opts,
    )
