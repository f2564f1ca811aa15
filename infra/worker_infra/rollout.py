"""How long a Deployment's rollout may take, so Pulumi's wait is bounded and sized from it.

pulumi-kubernetes waits for every Deployment it creates or updates until its rollout is
complete, 10 minutes by default, then fails ``pulumi up`` while the rollout carries on.
A pool rolls without surge, one pod at a time, and a pool holding downstream resources
waits a grace period between replacements (``minReadySeconds``): at the caps a prod pool
takes far longer than 10 minutes. Each Deployment therefore carries the
``pulumi.com/timeoutSeconds`` annotation (:data:`TIMEOUT_ANNOTATION`, the provider's await
timeout of create and update, visible in the rendered manifests) and the same number as
its ``customTimeouts`` (which the provider prefers), computed here, a pure function of
what the rollout does:

``steps = ceil(replicas / (max_surge + max_unavailable))`` batches, each a new pod
started and ready (:data:`POD_START_S`) then ``minReadySeconds`` available, and the
last old pod's grace period (it drains while its replacement starts):

``timeout = steps x (POD_START_S + min_ready_s) + grace_s``.

``replicas`` is the pool's capped maximum: the scaler may hold it there while a rollout
runs (the Deployment's own ``spec.replicas`` belongs to the scaler).
"""

from __future__ import annotations

#: The Deployment annotation pulumi-kubernetes reads as its await timeout (seconds).
TIMEOUT_ANNOTATION = "pulumi.com/timeoutSeconds"
#: Seconds a new pod may take to be ready: scheduling, image pull, boot, a first
#: readiness pass (probed every 10 s, 3 failures of 5 s allowed).
POD_START_S = 60


def rollout_timeout_s(
    replicas: int,
    max_surge: int,
    max_unavailable: int,
    min_ready_s: int,
    grace_s: int,
    pod_start_s: int = POD_START_S,
) -> int:
    """Seconds Pulumi waits at most for the rollout of a Deployment.

    Parameters:
      replicas: pods the rollout replaces (the pool's capped maximum; at least one step
        is counted, so a pool at zero still gets a bound).
      max_surge, max_unavailable: the RollingUpdate strategy (a batch is their sum).
      min_ready_s: the Deployment's ``minReadySeconds`` (0 when unset).
      grace_s: ``terminationGracePeriodSeconds`` of the last old pod.
      pod_start_s: seconds one new pod takes to be ready (default :data:`POD_START_S`).
    """
    if min(replicas, max_surge, max_unavailable, min_ready_s, grace_s) < 0 or not (
        max_surge + max_unavailable
    ):
        raise ValueError(
            f"rollout of {replicas} replicas, surge {max_surge}, unavailable "
            f"{max_unavailable}, minReadySeconds {min_ready_s}, grace {grace_s}: "
            "no negative number, and surge + unavailable at least 1"
        )
    batch = max_surge + max_unavailable
    steps = max(1, -(-replicas // batch))
    return steps * (pod_start_s + min_ready_s) + grace_s
