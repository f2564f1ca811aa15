"""A real node for the control plane of :mod:`cluster`: containerd, runc, the bridge CNI and
the kubelet (``make e2e``), contained so that the host is left as it was.

Containment (what a node changes, and where it goes instead):

- **processes**: a holder (``unshare --net --mount --pid --fork --kill-child --mount-proc``)
  whose PID 1 reaps orphans; containerd, the shims, the containers, the kubelet and whatever
  :meth:`Node.spawn` starts run in its PID namespace (``nsenter``), so when the holder dies
  (stopped, or SIGKILLed with the harness: ``PR_SET_PDEATHSIG``) the kernel kills them all;
- **network**: the node's own network namespace: the bridge ``cni0`` (the pods' gateway,
  :data:`GATEWAY`), the veths, ``ip_forward`` and any iptables chain the kubelet or a CNI
  plugin makes live and die there; the kubelet reaches the API server through a relay
  (:class:`relay.Relay`) from the node's loopback to the host's;
- **mounts and files**: the holder's private mount namespace: a fresh tmpfs on ``/run``
  (containerd's sockets, the pods' network namespaces) and on ``/var/lib`` (what cannot be
  configured: libcni's cache, the kubelet's device-plugin socket), the overlay rootfs and
  volume mounts, all gone with it; every other folder of containerd, the kubelet and CNI is
  configured under the work folder;
- **cgroups** (global in cgroup v1): the kubelet's ``cgroupRoot`` is ``/e2e-node-<pid>`` in
  every hierarchy, made here and removed at the stop (and, for a harness that was killed,
  at the next start, once no process is left in it);
- **sysctls**: the kubelet sets a few global ones at start (``vm.overcommit_memory``,
  ``kernel.panic``...: :data:`KERNEL_TUNABLES`); their values are saved first (in a file of the
  cache, so a killed harness's are restored at the next start) and written back at the stop.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import relay

if TYPE_CHECKING:
    import cluster as cl

NODE = "e2e-node"
POD_CIDR = "10.244.0.0/24"
#: The bridge's address in the node's network: the pods' gateway, and where the node's own
#: services (Redis, Prometheus) listen for the pods.
GATEWAY = "10.244.0.1"
BRIDGE = "cni0"
#: What the kubelet writes at start unless ``protectKernelDefaults`` (which refuses to start
#: when they differ): saved and restored.
KERNEL_TUNABLES = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
CGROUPS = Path("/sys/fs/cgroup")
CNI_BIN = "/usr/lib/cni"
#: PID 1 of the node's PID namespace: reaps the orphans (the shims re-parent to it), exits on
#: SIGTERM (and the kernel then kills every process of the namespace).
REAPER = """
import os, signal, time
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.5)
"""


def cgroup_hierarchies() -> list[Path]:
    """The mounted cgroup v1 hierarchies (``/sys/fs/cgroup/<controllers>``)."""
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, target, kind, *_ = line.split()
        if kind == "cgroup" and target.startswith(str(CGROUPS)):
            out.append(Path(target))
    return out


def remove_cgroup(root: str) -> list[str]:
    """Remove ``root`` from every hierarchy, deepest first; what could not be removed."""
    left = []
    for hierarchy in cgroup_hierarchies():
        top = hierarchy / root.strip("/")
        if not top.exists():
            continue
        for folder in sorted(
            (p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)
        ):
            with contextlib.suppress(OSError):
                folder.rmdir()
        try:
            top.rmdir()
        except OSError as error:
            left.append(f"{top}: {error}")
    return left


def read_tunables() -> dict[str, str]:
    return {
        name: (Path("/proc/sys") / name).read_text().strip() for name in KERNEL_TUNABLES
    }


def write_tunables(values: dict[str, str]) -> None:
    for name, value in values.items():
        path = Path("/proc/sys") / name
        if path.read_text().strip() != value:
            path.write_text(value + "\n")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def state_dir() -> Path:
    """Where each running node records what it must restore: ``<cache>/node-state``."""
    import build

    return build.cache_dir() / "node-state"


def sweep_dead_runs(state: Path, say: Any) -> None:
    """Restore what a killed harness left: its sysctls and its cgroup root (a run whose
    holder is gone; its record is ``<state>/<pid>.json``)."""
    if not state.is_dir():
        return
    for record in state.glob("*.json"):
        pid = int(record.stem)
        if pid_alive(pid):
            continue
        saved = json.loads(record.read_text())
        write_tunables(saved["tunables"])
        left = remove_cgroup(saved["cgroup_root"])
        say(
            f"e2e: node of a killed run ({pid}) cleaned up"
            + (f"; left {left}" if left else "")
        )
        if not left:
            record.unlink()


@dataclass
class Node:
    """The real node of a :class:`cluster.Cluster` (see the module doc)."""

    cluster: cl.Cluster
    #: OCI archives imported into containerd before the kubelet starts.
    images: tuple[Path, ...] = ()
    #: The sandbox ("pause") image, imported with ``images``: any image whose command sleeps.
    sandbox_image: str = ""
    state: Path = field(default_factory=lambda: state_dir())
    holder: cl.Process | None = None
    pid1: int = 0
    relays: list[relay.Relay] = field(default_factory=list)
    cgroup_root: str = ""
    saved: dict[str, str] = field(default_factory=dict)

    @property
    def dir(self) -> Path:
        return self.cluster.dir / "node"

    @property
    def netns(self) -> str:
        return f"/proc/{self.pid1}/ns/net"

    #: containerd's socket and state, in the node's own /run (a unix socket's path is short).
    containerd_socket = Path("/run/containerd/containerd.sock")

    # ---- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        sweep_dead_runs(self.state, self.cluster.say)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._holder()
        self._network()
        self._cgroups()
        self._containerd()
        for archive in self.images:
            started = time.monotonic()
            self.ctr("images", "import", "--snapshotter", "overlayfs", str(archive))
            self.cluster.say(
                f"e2e: {archive.name} imported in {time.monotonic() - started:.1f} s"
            )
        self._digest_names()
        self._kubelet()

    def stop(self) -> None:
        """Everything of the node ends with its holder; then the host's cgroups and sysctls
        as they were."""
        for r in self.relays:
            r.close()
        self.relays.clear()
        if self.holder is not None and self.holder.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid1, signal.SIGTERM)
            try:
                self.holder.popen.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.holder.popen.pid, signal.SIGKILL)
                self.holder.popen.wait()
        left: list[str] = []
        if self.cgroup_root:
            deadline = time.monotonic() + 15
            while (
                left := remove_cgroup(self.cgroup_root)
            ) and time.monotonic() < deadline:
                time.sleep(0.5)
        if self.saved:
            write_tunables(self.saved)
        record = self.state / f"{os.getpid()}.json"
        if not left:
            record.unlink(missing_ok=True)
        else:
            self.cluster.say(f"e2e: node cgroups left: {left}")

    # ---- running in the node ------------------------------------------------------------

    def enter(self, *, pid: bool = True) -> list[str]:
        """The ``nsenter`` prefix of a command run in the node's namespaces."""
        spaces = ["--net", "--mount", *(["--pid"] if pid else [])]
        return ["nsenter", f"--target={self.pid1}", *spaces, "--"]

    def spawn(self, name: str, argv: list[str]) -> cl.Process:
        """A long-running process in the node (stopped by the cluster, killed with the node)."""
        return self.cluster._spawn(name, [*self.enter(), *argv])

    def run(self, *argv: str) -> str:
        done = subprocess.run(
            [*self.enter(), *argv], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)}: {done.returncode}\n{done.stderr[-3000:]}"
            )
        return done.stdout

    def ctr(self, *args: str) -> str:
        return self.run(
            "ctr", f"--address={self.containerd_socket}", "--namespace=k8s.io", *args
        )

    # ---- pieces -----------------------------------------------------------------------

    def _holder(self) -> None:
        self.holder = self.cluster._spawn(
            "node-holder",
            [
                "unshare",
                "--net",
                "--mount",
                "--pid",
                "--fork",
                "--kill-child",
                "--mount-proc",
                "--propagation",
                "private",
                sys.executable,
                "-c",
                REAPER,
            ],
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            kids = [
                int(c)
                for task in Path(f"/proc/{self.holder.popen.pid}/task").iterdir()
                for c in (task / "children").read_text().split()
            ]
            if kids:
                self.pid1 = kids[0]
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(
                f"node holder: no child ({self.holder.log.read_text()[-2000:]})"
            )
        # The holder's record: what a killed harness leaves is restored at the next start.
        self.saved = read_tunables()
        self.cgroup_root = f"e2e-node-{os.getpid()}"
        (self.state / f"{os.getpid()}.json").write_text(
            json.dumps({"tunables": self.saved, "cgroup_root": self.cgroup_root})
        )

    def _network(self) -> None:
        """Loopback up, a fresh /run, the bridge with the pods' gateway; the API server's port
        on the node's loopback relayed to the host's."""
        script = (
            "set -e; mount -t tmpfs -o mode=755 tmpfs /run; mkdir -p /run/lock;"
            # What is not configurable: libcni's cache (/var/lib/cni), the kubelet's
            # device-plugin socket (/var/lib/kubelet/device-plugins).
            " mount -t tmpfs -o mode=755 tmpfs /var/lib;"
            # The kubelet's folder at its default path (its sockets' paths must be short).
            f" mkdir -p /var/lib/kubelet {self.dir / 'kubelet'};"
            f" mount --bind {self.dir / 'kubelet'} /var/lib/kubelet;"
            " ip link set lo up;"
            f" ip link add {BRIDGE} type bridge; ip addr add {GATEWAY}/24 dev {BRIDGE};"
            f" ip link set {BRIDGE} up"
        )
        self.run("sh", "-c", script)
        port = int(self.cluster.server.rsplit(":", 1)[1])
        self.relays.append(
            relay.Relay(
                listen=(self.netns, "127.0.0.1", port),
                connect=(None, "127.0.0.1", port),
            )
        )

    def _cgroups(self) -> None:
        for hierarchy in cgroup_hierarchies():
            top = hierarchy / self.cgroup_root
            top.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (hierarchy / name).exists():
                    (top / name).write_text((hierarchy / name).read_text())

    def _containerd(self) -> None:
        base = self.dir / "containerd"
        (self.dir / "cni" / "net.d").mkdir(parents=True, exist_ok=True)
        (self.dir / "cni" / "net.d" / "10-e2e.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "1.0.0",
                    "name": "e2e",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": BRIDGE,
                            "isGateway": True,
                            "ipMasq": False,
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": POD_CIDR, "gateway": GATEWAY}]],
                                "dataDir": str(self.dir / "cni" / "ipam"),
                            },
                        }
                    ],
                },
                indent=1,
            )
        )
        config = base / "config.toml"
        base.mkdir(parents=True, exist_ok=True)
        config.write_text(
            CONTAINERD_CONFIG.format(
                root=base / "root",
                state="/run/containerd",
                socket=self.containerd_socket,
                opt=base / "opt",
                cni_bin=CNI_BIN,
                cni_conf=self.dir / "cni" / "net.d",
                sandbox_image=self.sandbox_image,
            )
        )
        proc = self.spawn("containerd", ["containerd", f"--config={config}"])

        def ready() -> bool:
            self.ctr("version")
            return True

        self.cluster._wait(proc, "containerd", ready)

    def _digest_names(self) -> None:
        """Each imported ``repo:tag`` also named ``repo@<digest>``: a pod names its image by
        digest (worker_infra pulls those IfNotPresent), and the CRI finds a local image by a
        digest only under such a name (an import makes none; a pull does)."""
        for line in self.ctr("images", "ls").splitlines()[1:]:
            ref, _, digest, *_ = line.split()
            repo, _, tag = ref.rpartition(":")
            if not ref.startswith("sha256:") and "@" not in ref and "/" not in tag and repo:
                with contextlib.suppress(RuntimeError):  # already named (a second import)
                    self.ctr("images", "tag", ref, f"{repo}@{digest}")

    def _kubelet(self) -> None:
        kubeconfig = self.cluster._kubeconfig(
            "kubelet", self.dir / "kubelet.kubeconfig"
        )
        config = self.dir / "kubelet.yaml"
        healthz = cl_free_port()
        config.write_text(
            json.dumps(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    "failCgroupV1": False,
                    "cgroupDriver": "cgroupfs",
                    "cgroupRoot": f"/{self.cgroup_root}",
                    "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
                    "address": "127.0.0.1",
                    "port": cl_free_port(),
                    "readOnlyPort": 0,
                    "healthzBindAddress": "127.0.0.1",
                    "healthzPort": healthz,
                    "authentication": {
                        "anonymous": {"enabled": False},
                        "webhook": {"enabled": False},
                    },
                    "authorization": {"mode": "AlwaysAllow"},
                    "podLogsDir": str(self.dir / "pod-logs"),
                    "failSwapOn": False,
                    "resolvConf": "",
                    "evictionHard": {
                        "memory.available": "100Mi",
                        "nodefs.available": "1%",
                        "imagefs.available": "1%",
                        "nodefs.inodesFree": "1%",
                    },
                    "imageGCHighThresholdPercent": 100,
                    "imageGCLowThresholdPercent": 99,
                    "serializeImagePulls": False,
                    "registerNode": True,
                    "nodeStatusUpdateFrequency": "4s",
                    "syncFrequency": "5s",
                },
                indent=1,
            )
        )
        proc = self.spawn(
            "kubelet",
            [
                self.cluster.binaries.find("kubelet"),
                f"--config={config}",
                f"--kubeconfig={kubeconfig}",
                f"--hostname-override={NODE}",
                f"--node-ip={GATEWAY}",
                "--v=1",
            ],
        )

        def node_ready() -> bool:
            node = self.cluster.api("GET", f"/api/v1/nodes/{NODE}")
            conditions = {
                c["type"]: c["status"] for c in node["status"].get("conditions", [])
            }
            return conditions.get("Ready") == "True"

        self.cluster._wait(proc, "real node", node_ready)


def cl_free_port() -> int:
    """A TCP port free on the node's loopback: any port, its loopback is its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CONTAINERD_CONFIG = """\
version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox_image}"
  # The kubelet asks for oom_score_adj -998, which needs CAP_SYS_RESOURCE (absent here):
  # without this, every sandbox fails (runc: can't get final child's PID from pipe: EOF).
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  netns_mounts_under_state_dir = true
  enable_selinux = false

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    discard_unpacked_layers = false

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
"""
