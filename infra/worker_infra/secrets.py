"""The service's Secrets: their names, their keys, the variables that read them, their builders.

One module for every credential worker_infra deploys, so a key is spelled once and the
variable that reads it is bound to it once:

* the broker Secret ``<project>-broker`` (:func:`broker_secret_name`): ``redis-url``
  (``REDIS_URL``), ``redis-password`` when the broker has one (the TriggerAuthentication of
  KEDA's ``redis`` triggers reads it), and in the sandbox namespace, with an ACL user,
  ``redis-username`` too and that user's password, never the shared one;
* the database Secret ``<project>-database`` (:func:`database_secret_name`):
  ``database-url`` (``DATABASE_URL``), only when a pool uses the database.

Values reach containers as ``secretKeyRef`` only (:func:`broker_env`, :func:`database_env`
give ``workload.container_env`` its ``(variable, secret, key)`` triples); never as plain
values (the guards check it).
"""

from __future__ import annotations

from collections.abc import Mapping

import pulumi
import pulumi_kubernetes as k8s

from .acl import acl_broker_url
from .args import BrokerSpec, SandboxSpec

#: The broker Secret's key of the Redis URL (``REDIS_URL``).
BROKER_URL_KEY = "redis-url"
#: The broker Secret's key of the Redis password (KEDA's TriggerAuthentication).
BROKER_PASSWORD_KEY = "redis-password"
#: The sandbox's broker Secret's key of its Redis ACL user name.
BROKER_USERNAME_KEY = "redis-username"
#: The database Secret's key of the database URL (``DATABASE_URL``).
DATABASE_URL_KEY = "database-url"
#: What every broker Secret's name ends with (the policy checks finds them by it).
BROKER_SECRET_SUFFIX = "-broker"
#: What the database Secret's name ends with.
DATABASE_SECRET_SUFFIX = "-database"

#: ``(variable, secret, key)``: a container variable read from a Secret's key.
SecretEnv = tuple[str, str, str]


def broker_secret_name(project: str) -> str:
    """The name of the broker Secret of ``project`` (in each namespace it deploys to)."""
    return project + BROKER_SECRET_SUFFIX


def database_secret_name(project: str) -> str:
    """The name of the database Secret of ``project``."""
    return project + DATABASE_SECRET_SUFFIX


def broker_env(secret: str) -> SecretEnv:
    """``REDIS_URL`` from the broker Secret ``secret``."""
    return ("REDIS_URL", secret, BROKER_URL_KEY)


def database_env(secret: str) -> SecretEnv:
    """``DATABASE_URL`` from the database Secret ``secret``."""
    return ("DATABASE_URL", secret, DATABASE_URL_KEY)


def opaque_secret(
    name: str,
    secret_name: str,
    namespace: pulumi.Input[str],
    data: Mapping[str, pulumi.Input[str]],
    labels: dict[str, str],
    opts: pulumi.ResourceOptions,
) -> k8s.core.v1.Secret:
    """The Opaque Secret ``secret_name`` holding ``data`` (Pulumi resource ``name``)."""
    return k8s.core.v1.Secret(
        name,
        metadata=k8s.meta.v1.ObjectMetaArgs(name=secret_name, namespace=namespace, labels=labels),
        type="Opaque",
        string_data=dict(data),
        opts=opts,
    )


def broker_secret(
    name: str,
    secret_name: str,
    namespace: pulumi.Input[str],
    broker: BrokerSpec,
    labels: dict[str, str],
    opts: pulumi.ResourceOptions,
) -> k8s.core.v1.Secret:
    """The broker credentials: ``redis-url`` and (with a password) ``redis-password``."""
    data: dict[str, pulumi.Input[str]] = {BROKER_URL_KEY: broker.url()}
    if broker.password is not None:
        data[BROKER_PASSWORD_KEY] = pulumi.Output.secret(broker.password)
    return opaque_secret(name, secret_name, namespace, data, labels, opts)


def acl_broker_secret(
    name: str,
    secret_name: str,
    namespace: pulumi.Input[str],
    broker: BrokerSpec,
    sandbox: SandboxSpec,
    labels: dict[str, str],
    opts: pulumi.ResourceOptions,
) -> k8s.core.v1.Secret:
    """The sandbox's own broker credentials (its ACL user): ``redis-url``,
    ``redis-username``, ``redis-password``; never the shared password."""
    assert sandbox.broker_user and sandbox.broker_password is not None
    data: dict[str, pulumi.Input[str]] = {
        BROKER_URL_KEY: acl_broker_url(broker, sandbox.broker_user, sandbox.broker_password),
        BROKER_USERNAME_KEY: sandbox.broker_user,
        BROKER_PASSWORD_KEY: pulumi.Output.secret(sandbox.broker_password),
    }
    return opaque_secret(name, secret_name, namespace, data, labels, opts)


def database_secret(
    name: str,
    secret_name: str,
    namespace: pulumi.Input[str],
    database_url: pulumi.Input[str],
    labels: dict[str, str],
    opts: pulumi.ResourceOptions,
) -> k8s.core.v1.Secret:
    """The database credentials: ``database-url``."""
    data = {DATABASE_URL_KEY: pulumi.Output.secret(database_url)}
    return opaque_secret(name, secret_name, namespace, data, labels, opts)
