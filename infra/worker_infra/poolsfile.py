"""The stack-merged, validated pools file, mounted into every pod from a ConfigMap.

The worker reads its pool's shape from this file (``WORKER_POOLS_FILE``), so what the
guards checked is what runs; a checksum annotation on the pod template rolls the pods
when the file changes.
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


def checksum(text: str) -> str:
    """SHA-256 (hex) of the pools file's text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def pools_config_map(
    name: str,
    config_map_name: str,
    namespace: pulumi.Input[str],
    text: str,
    labels: dict[str, str],
    opts: pulumi.ResourceOptions,
) -> k8s.core.v1.ConfigMap:
    """A ConfigMap ``config_map_name`` holding ``text`` under :data:`POOLS_KEY` (immutable
    contents are replaced, never edited in place: a change rolls the pods through the
    checksum annotation)."""
    return k8s.core.v1.ConfigMap(
        name,
        metadata=k8s.meta.v1.ObjectMetaArgs(
            name=config_map_name, namespace=namespace, labels=labels
        ),
        data={POOLS_KEY: text},
        opts=opts,
    )
