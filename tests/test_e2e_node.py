"""`make e2e`: the real node of scripts/e2e/node.py (containerd, runc, the bridge CNI, the
kubelet) runs a pod, and leaves the host as it was: no process, mount, network link, iptables
chain, cgroup, sysctl or file of its own, whether the harness is stopped (Ctrl-C) or killed
(SIGKILL: the kernel ends the node's namespaces; the cgroups and sysctls it cannot reach are
restored by the next start, or ``cluster.py --sweep``).

Needs root, Debian's containerd, runc and containernetworking-plugins, buildah and
debootstrap (.ci/run installs them), and the engines of `make e2e-build`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from bakery import TEMPLATE

E2E = TEMPLATE / "scripts" / "e2e"
sys.path.insert(0, str(E2E))
import build  # noqa: E402
import node  # noqa: E402

pytestmark = pytest.mark.e2e

#: Host files a node must not leave (their defaults in containerd, the kubelet and CNI).
HOST_PATHS = ("/var/lib/cni", "/var/lib/kubelet", "/var/lib/containerd", "/var/log/pods",
              "/run/containerd", "/run/netns", "/opt/containerd", "/etc/cni/net.d",
              "/etc/kubernetes")
SYSCTLS = (*node.KERNEL_TUNABLES, "net/ipv4/ip_forward", "net/ipv4/conf/all/forwarding")


def require_node() -> None:
    cache = build.cache_dir()
    missing = [e for e in ("k8s", "kubelet")
               if not (cache / "bin" / build.ENGINES[e].key / ".ok").exists()]
    missing += [t for t in ("containerd", "runc", "buildah", "debootstrap", "etcd", "ctr")
                if shutil.which(t) is None]
    if os.geteuid() != 0:
        missing.append("root")
    if missing:
        message = f"the real node needs {', '.join(missing)} (make e2e-build; .ci/run)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def host_state() -> dict[str, Any]:
    """What a node could leave behind on the host, read from the host's own namespaces."""
    mounts = sorted(line.split()[4] for line in Path("/proc/self/mountinfo").read_text()
                    .splitlines())
    cgroups = sorted(str(p) for h in node.cgroup_hierarchies() for p in h.iterdir() if p.is_dir())
    links = sorted(line.split(":")[1].strip().split("@")[0] for line in subprocess.run(
        ["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout.splitlines())
    rules = sorted(line for line in subprocess.run(
        ["iptables-save"], capture_output=True, text=True, check=True).stdout.splitlines()
        if line.startswith(("-", ":")))
    rules = [r.split(" [")[0] for r in rules]  # chain counters change
    return {
        "mounts": mounts,
        "cgroups": cgroups,
        "links": links,
        "iptables": rules,
        "sysctls": {s: (Path("/proc/sys") / s).read_text().strip() for s in SYSCTLS},
        "paths": [p for p in HOST_PATHS if Path(p).exists()
                  and (not Path(p).is_dir() or any(Path(p).iterdir()))],
        "processes": node_processes(),
    }


def node_processes() -> list[str]:
    """Live processes of a node: containerd, its shims, kubelets, holders."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z" and any(w in cmdline for w in ("containerd", "kubelet", "--kill-child")):
            out.append(cmdline[:160])
    return sorted(out)


def start_real_node(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen(
        [sys.executable, str(E2E / "cluster.py"), "--node", "real"],
        stdout=subprocess.PIPE, stderr=(tmp_path / "harness.log").open("w"), text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.endswith("admin.kubeconfig"), (tmp_path / "harness.log").read_text()[-3000:]
    return proc, Path(line)


def api(kubeconfig: Path, method: str, path: str, body: Any = None) -> Any:
    config = json.loads(kubeconfig.read_text())
    cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
    ca = kubeconfig.parent / "certs" / "apiserver.crt"
    request = urllib.request.Request(
        cluster["server"] + path, method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {user['token']}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30,
                                context=ssl.create_default_context(cafile=str(ca))) as r:
        return json.loads(r.read())


def run_a_pod(kubeconfig: Path) -> dict[str, Any]:
    """A pod of the sandbox image on the real node: Running, with an IP of the bridge."""
    image = node_sandbox_image(kubeconfig)
    api(kubeconfig, "POST", "/api/v1/namespaces/default/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sleeper"},
        "spec": {"containers": [{"name": "c", "image": image,
                                 "resources": {"limits": {"memory": "64Mi", "cpu": "100m"}}}],
                 "terminationGracePeriodSeconds": 1}})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pod = api(kubeconfig, "GET", "/api/v1/namespaces/default/pods/sleeper")
        if pod["status"].get("phase") == "Running":
            return dict(pod)
        time.sleep(1)
    raise AssertionError(f"the pod did not run: {pod['status']}")


def node_sandbox_image(kubeconfig: Path) -> str:
    """The sandbox image the node imported (it is on the node: no pull)."""
    n = api(kubeconfig, "GET", f"/api/v1/nodes/{node.NODE}")
    names = [name for image in n["status"].get("images", []) for name in image["names"]]
    (pause,) = [name for name in names if "e2e-pause" in name and "@" not in name]
    return str(pause)


@pytest.mark.timeout(600)
def test_a_real_node_runs_a_pod_and_leaves_the_host_as_it_was(tmp_path: Path) -> None:
    require_node()
    subprocess.run([sys.executable, str(E2E / "cluster.py"), "--sweep"], check=True)
    before = host_state()
    proc, kubeconfig = start_real_node(tmp_path)
    try:
        pod = run_a_pod(kubeconfig)
        assert pod["status"]["podIP"].startswith(node.GATEWAY.rsplit(".", 1)[0] + "."), pod
        during = host_state()
        assert during["processes"], "no node process while it runs"
        # Inside the node's namespaces, not the host's: the bridge, its address, the mounts.
        assert "cni0" not in during["links"]
        assert not [m for m in during["mounts"] if str(tmp_path) in m]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0, (tmp_path / "harness.log").read_text()[-3000:]
    assert host_state() == before


@pytest.mark.timeout(600)
def test_a_killed_harness_leaves_no_node_process_and_the_sweep_restores_the_rest(
    tmp_path: Path,
) -> None:
    require_node()
    subprocess.run([sys.executable, str(E2E / "cluster.py"), "--sweep"], check=True)
    before = host_state()
    proc, kubeconfig = start_real_node(tmp_path)
    run_a_pod(kubeconfig)
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 30
    while node_processes() != before["processes"] and time.monotonic() < deadline:
        time.sleep(0.5)
    after_kill = host_state()
    assert after_kill["processes"] == before["processes"]
    for part in ("mounts", "links", "iptables", "paths"):
        assert after_kill[part] == before[part], part
    subprocess.run([sys.executable, str(E2E / "cluster.py"), "--sweep"], check=True)
    assert host_state() == before
