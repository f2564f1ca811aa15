"""The launcher that :func:`.sandbox.run_untrusted` executes as the sandbox child.

It runs as ``python -I -S _child.py <config>`` (standard library only, never
imported by the worker), confines itself and then runs the customer's snippet:

1. reads its seccomp program (built by the worker, :mod:`._seccomp`) and the
   payload (JSON) from stdin, and keeps a private copy of stdout for the result; the
   snippet's own ``print`` output goes to stderr;
2. enters new network, IPC and mount namespaces where it can (``netns``, ``ipcns``,
   ``private-mounts``, ``disk-quota``: a tmpfs of ``Limits.max_disk_bytes`` over the private
   directory, and a directory of it over every place the snippet could write, found by the
   worker's walk of the filesystem: /tmp, /var/tmp, /dev/shm, /run/lock, ...), as root or
   inside a new user namespace with a uid of its own (``userns``, ``own-uid``);
3. sets ``no_new_privs`` and applies Landlock where the kernel has it: writes only
   under the private working directory, reads only from the Python installation,
   system libraries and the working directory (``landlock-fs``), no TCP bind or
   connect (``landlock-net``), no signals to processes outside the sandbox
   (``landlock-signal``);
   Without either ``landlock-fs`` or ``private-mounts`` the snippet would keep the worker
   uid's file rights (other runs' private directories, the pod's state files, files that
   outlive the run) and could see processes of the pod in their first, still dumpable
   milliseconds: the launcher then refuses (exit :data:`UNCONTAINED`, the message naming
   the missing layers), always;
4. as root, drops to uid = gid = ``ID_BASE + pid`` with no groups (``own-uid``); drops
   every capability (``no-caps``);
5. sets the resource limits (``rlimits``), ``RLIMIT_NPROC`` = ``max_threads`` where the
   uid is its own;
6. loads the seccomp allowlist: everything not listed fails with ``EPERM``
   (``seccomp-allowlist``);
7. writes one JSON line ``{"layers": [...]}`` to the result channel, runs
   ``main(payload)`` from the snippet and writes one JSON line with the outcome.

A failure before step 7 exits with :data:`SETUP_FAILED` and a message on stderr.
"""

from __future__ import annotations

import ctypes

# First of all, before the other imports: non-dumpable, so no other process of the worker's
# uid (a sibling run's snippet, where snippets keep that uid) can open this one's
# /proc/<pid>/mem, environ, cwd or fd, before the snippet runs (no seccomp yet) or while it
# does. A new identity (setresuid, capset) sets it to fs.suid_dumpable: main() clears it again.
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE

import _json  # noqa: E402
import _signal  # type: ignore[import-not-found]  # noqa: E402 - not signal: see below
import errno  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import stat  # noqa: E402
import sys  # noqa: E402

# Start-up time is the sandbox's overhead on every run (bench/sandbox_overhead.py): the
# launcher imports no module that pulls in enum, re or typing (json, signal, typing: about
# half of its import time). JSON goes through the C accelerator that json itself uses.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

SETUP_FAILED = 70
#: ``RLIMIT_SIGPENDING`` of the snippet: signals queued to it at once (CPython queues none).
MAX_PENDING_SIGNALS = 64
#: Exit code of a refusal: no layer contains the snippet's file writes (``EX_CONFIG``).
UNCONTAINED = 78
_MAX_ERROR_CHARS = 4000

# -- Linux constants ------------------------------------------------------------------

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_SECCOMP_MODE_FILTER = 2
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC, _MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 21
_MS_PRIVATE = 1 << 18
#: statvfs flags a remount must keep (a user namespace may not clear them: locked).
_KEPT_FLAGS = _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_NOATIME | _MS_NODIRATIME
_ST_RELATIME = 4096
_SYS_MOUNT_SETATTR = {"x86_64": 442, "aarch64": 442}
_AT_RECURSIVE = 0x8000
_MOUNT_ATTR_RDONLY = 1
#: A root worker runs the snippet as uid = gid = ``ID_BASE + pid``: an identity of its own
#: (no file, process or IPC object on the host has it), so ``RLIMIT_NPROC`` counts
#: exactly the snippet's threads and nothing of the worker's.
ID_BASE = 2_000_000_000
#: Inside its own user namespace (non-root worker), the snippet is uid/gid 1000.
NAMESPACE_ID = 1000

# Landlock (include/uapi/linux/landlock.h).
_SYS_LANDLOCK = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_FS_EXECUTE = 1 << 0
_FS_WRITE_FILE = 1 << 1
_FS_READ_FILE = 1 << 2
_FS_READ_DIR = 1 << 3
_FS_WRITE_DIR_ONLY = sum(1 << bit for bit in range(4, 13))  # remove/make dir, reg, sym, ...
_FS_REFER = 1 << 13  # ABI 2
_FS_TRUNCATE = 1 << 14  # ABI 3
_FS_IOCTL_DEV = 1 << 15  # ABI 5
_NET_BIND_TCP = 1 << 0  # ABI 4
_NET_CONNECT_TCP = 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
_SCOPE_SIGNAL = 1 << 1
_READABLE_SYSTEM_PATHS = (
    "/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/proc",
    "/sys/devices/system/cpu", "/dev/null", "/dev/zero", "/dev/urandom", "/dev/random",
)  # fmt: skip

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_PR_GET_DUMPABLE, _PR_SET_DUMPABLE = 3, 4


class SetupError(Exception):
    """The sandbox could not be set up; nothing of the snippet has run."""


class UncontainedError(SetupError):
    """No layer keeps the snippet's file writes from outliving the run (a refusal)."""


#: The layers that keep a snippet's file writes inside its run: Landlock (writes only under
#: the private directory) or a mount namespace with private tmpfs over the shared places.
FILE_WALLS = ("landlock-fs", "private-mounts")


def _check_file_wall(layers: list[str]) -> None:
    """Refuse unless a layer of :data:`FILE_WALLS` is active (no opt-in: issue #25)."""
    if any(layer in layers for layer in FILE_WALLS):
        return
    raise UncontainedError(
        "no layer keeps the snippet from the worker's files and processes (its uid's file "
        "rights: other runs' private directories, the pod's state files; /proc of processes "
        "still dumpable at their start): landlock-fs is missing (Landlock, Linux 5.13+) and "
        "so is private-mounts (user namespaces, or a root worker). Run the sandbox pool "
        "under gVisor or on a kernel with Landlock (docs/sandbox.md)"
    )


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [
        ("allowed_access", ctypes.c_uint64),
        ("parent_fd", ctypes.c_int32),
    ]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _errno_text() -> str:
    return os.strerror(ctypes.get_errno())


# -- Identity and namespaces -----------------------------------------------------------


def _map_ids(uid: int, gid: int) -> None:
    """Map ``uid``/``gid`` to :data:`NAMESPACE_ID` in the new user namespace. The map files
    of a non-dumpable process belong to root: dumpable for the three ``open`` calls only,
    non-dumpable again before they are written."""
    texts = {"setgroups": "deny", "uid_map": f"{NAMESPACE_ID} {uid} 1",
             "gid_map": f"{NAMESPACE_ID} {gid} 1"}  # fmt: skip
    _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
    try:  # a failure ends the launcher (SetupError): nothing to close
        handles = [open(f"/proc/self/{name}", "w") for name in texts]  # noqa: SIM115
    finally:
        _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    for handle, text in zip(handles, texts.values(), strict=True):
        with handle:
            handle.write(text)


def _own_namespaces(
    workdir: str, limits: dict[str, Any], off: set[str], places: dict[str, list[str]]
) -> tuple[list[str], int | None]:
    """New network and IPC namespaces, and an identity of the snippet's own.

    Returns the layers and, for a root worker, the uid/gid to drop to (after Landlock);
    ``None`` when the snippet keeps the worker's uid (no user namespaces: the restricted
    pod), or when it already has its own uid inside a new user namespace.
    """
    if os.geteuid() == 0:  # root outside a pod: CAP_SYS_ADMIN creates the namespaces
        layers = []
        if "netns" not in off and _libc.unshare(_CLONE_NEWNET) == 0:
            layers.append("netns")
        if _libc.unshare(_CLONE_NEWIPC) == 0:
            layers.append("ipcns")
        if _libc.unshare(_CLONE_NEWNS) == 0:
            layers += _private_mounts(workdir, limits, places, off)
        ident = ID_BASE + os.getpid()
        os.chown(workdir, ident, ident)
        return layers, ident
    if "userns" in off:
        return [], None
    uid, gid = os.geteuid(), os.getegid()
    flags = _CLONE_NEWUSER | _CLONE_NEWIPC | _CLONE_NEWNS
    flags |= 0 if "netns" in off else _CLONE_NEWNET
    if _libc.unshare(flags) != 0:
        return [], None  # typical for a restricted pod: RuntimeDefault seccomp refuses it
    try:  # map our own ids to NAMESPACE_ID, or files can no longer be created (EOVERFLOW)
        _map_ids(uid, gid)
    except OSError as exc:
        raise SetupError(f"cannot map ids in the new user namespace: {exc}") from exc
    layers = ["userns", "own-uid", "ipcns", *([] if "netns" in off else ["netns"])]
    return layers + _private_mounts(workdir, limits, places, off), None


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                   ctypes.c_ulong(flags), data.encode() if data else None) != 0:  # fmt: skip
        raise SetupError(f"cannot mount {target}: {_errno_text()}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]  # fmt: skip


def _unescape(field: str) -> str:
    """A path of ``/proc/self/mountinfo`` (space, tab, newline, backslash are octal)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _all_read_only(recursive: bool = True) -> None:
    """Make every mount of the run's new namespace read-only: no file of the host is then
    writable by the snippet, whatever its mode (a world-writable file in a directory nobody
    may write, one created after the worker's walk), only the run's own tmpfs, mounted
    after. One ``mount_setattr(AT_RECURSIVE)`` on ``/`` (5.12+); else a read-only bind
    remount of each mount point. Devices (``/dev/null``) stay writable: a read-only mount
    only stops changes to the filesystem. ``recursive=False`` (tests) takes the latter way."""
    number = _SYS_MOUNT_SETATTR.get(os.uname().machine) if recursive else None
    attr = _MountAttr(attr_set=_MOUNT_ATTR_RDONLY)
    if number is not None:
        args = (-100, b"/", _AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr))
        if _libc.syscall(number, *args) == 0:  # AT_FDCWD
            return
    with open("/proc/self/mountinfo") as handle:
        points = [_unescape(line.split()[4]) for line in handle]
    for point in points:
        try:
            flags = os.statvfs(point).f_flag
        except OSError:
            continue  # hidden under another mount, or gone
        kept = (flags & _KEPT_FLAGS) | (_MS_RELATIME if flags & _ST_RELATIME else 0)
        _mount("none", point, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | kept, None)


def _private_mounts(
    workdir: str, limits: dict[str, Any], places: dict[str, list[str]], off: set[str]
) -> list[str]:
    """The run's own size-limited filesystem, and every place it could write made its own.

    In the new mount namespace: a tmpfs of ``Limits.max_disk_bytes`` and ``max_files``
    inodes over the private directory (``disk-quota``: everything the run writes counts
    against it); an empty directory of that tmpfs bound over each directory the snippet's
    identity could write (``places["private"]``, enumerated by the worker: /tmp, /var/tmp,
    /dev/shm, /run/lock, a writable emptyDir, ...), so what it leaves there dies with the run
    and shares the one bound; those that hold the Python installation
    (``places["readonly"]``) stay read-only like every other mount of the namespace
    (:func:`_all_read_only`: no file of the host is writable, world-writable or not). The
    private directory is bound back at its path.
    """
    _mount("none", "/", None, _MS_REC | _MS_PRIVATE, None)  # nothing propagates out
    _all_read_only("mount_setattr" not in off)  # first: the run's own mounts stay writable
    size, inodes = int(limits["max_disk_bytes"]), int(limits["max_files"])
    _mount("tmpfs", workdir, "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={size},nr_inodes={inodes},mode=0700")  # fmt: skip
    keep = os.open(workdir, os.O_PATH | os.O_DIRECTORY)  # the tmpfs's root
    try:
        os.mkdir("run", 0o700, dir_fd=keep)  # the private directory, as the snippet sees it
        os.mkdir("shared", 0o711, dir_fd=keep)
        # /proc shows this process alone: no other process of the pod, not even one that is
        # still dumpable because it has just started (a probe, a sibling's launcher). Its own
        # /proc/<pid> is staged in the tmpfs (by path: workdir is not covered yet).
        os.mkdir("proc-self", 0o555, dir_fd=keep)
        _mount(f"/proc/{os.getpid()}", f"{workdir}/proc-self", None, _MS_BIND | _MS_REC, None)
        _mount("tmpfs", "/proc", "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
               "size=4k,nr_inodes=8,mode=0555")  # fmt: skip
        os.mkdir("/proc/self", 0o555)
        _mount(f"{workdir}/proc-self", "/proc/self", None, _MS_BIND | _MS_REC, None)
        for index, target in enumerate(places.get("private", ())):
            if not os.path.isdir(target) or os.path.islink(target):
                continue
            shared = f"/proc/self/fd/{keep}/shared/{index}"
            os.mkdir(shared)
            os.chmod(shared, 0o1777)  # noqa: S103 - like the place it stands for, in the run
            _mount(shared, target, None, _MS_BIND, None)
        if not os.path.isdir(workdir):  # it was under one of them
            os.makedirs(workdir, mode=0o711)
        _mount(f"/proc/self/fd/{keep}/run", workdir, None, _MS_BIND, None)
    except OSError as exc:
        raise SetupError(f"cannot make the run's places private: {exc}") from exc
    finally:
        os.close(keep)
    os.chdir(workdir)
    return ["private-mounts", "disk-quota", "private-proc"]


def _reachable_by_others(path: str) -> bool:
    """Whether a user without privileges can list ``path`` (every parent searchable)."""
    try:
        if not os.stat(path).st_mode & stat.S_IROTH:
            return False
        parent = os.path.dirname(path)
        while True:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            if parent == os.path.dirname(parent):
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


def _keep_imports_reachable() -> None:
    """Entries of ``sys.path`` the new uid could not reach by name (Python installed under
    ``/root``, say) are opened now and imported from through ``/proc/self/fd``, which
    checks the permissions of the directory itself, not of its parents. Packages already
    imported (``encodings``, which finds codecs lazily) get the same treatment."""
    moved: dict[str, str] = {}
    for index, entry in enumerate(sys.path):
        if entry and not _reachable_by_others(entry):
            try:
                fd = os.open(entry, os.O_PATH | os.O_DIRECTORY)
            except OSError:
                continue
            moved[entry] = sys.path[index] = f"/proc/self/fd/{fd}"
    for module in list(sys.modules.values()):
        paths = getattr(module, "__path__", None)
        if isinstance(paths, list):
            for index, path in enumerate(paths):
                for entry, replacement in moved.items():
                    if path.startswith(entry + os.sep):
                        paths[index] = replacement + path[len(entry) :]


def _drop_to(ident: int) -> list[str]:
    """Become ``ident`` (uid and gid), with no supplementary groups. Root worker only."""
    _keep_imports_reachable()
    try:
        os.setgroups([])
        os.setresgid(ident, ident, ident)
        os.setresuid(ident, ident, ident)  # also clears the permitted and effective caps
    except OSError as exc:
        raise SetupError(f"cannot drop to uid {ident}: {exc}") from exc
    if os.getresuid() != (ident,) * 3 or os.getgroups():
        raise SetupError(f"still not uid {ident} without groups after dropping")
    return ["own-uid"]


# -- Resource limits --------------------------------------------------------------------


def _set_rlimits(limits: dict[str, Any], own_uid: bool) -> list[str]:
    """The caps of :class:`.sandbox.Limits`. ``RLIMIT_NPROC`` counts the tasks (threads)
    of a real uid: set only when the snippet has a uid of its own, where it counts
    exactly the snippet's threads; with the worker's uid the worker polls instead."""
    cpu = int(limits["cpu_seconds"])
    settings = [
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL at hard
        (resource.RLIMIT_AS, int(limits["memory_bytes"]), int(limits["memory_bytes"])),
        (resource.RLIMIT_NOFILE, int(limits["max_open_files"]), int(limits["max_open_files"])),
        (resource.RLIMIT_FSIZE, int(limits["max_file_bytes"]), int(limits["max_file_bytes"])),
        (resource.RLIMIT_MSGQUEUE, 0, 0),
        # Queued signals count per uid: without a cap, a snippet with the worker's uid could
        # queue them all and leave the worker none (timer_create, sigqueue fail).
        (resource.RLIMIT_SIGPENDING, MAX_PENDING_SIGNALS, MAX_PENDING_SIGNALS),
        (resource.RLIMIT_MEMLOCK, 0, 0),
    ]
    if own_uid:
        threads = int(limits["max_threads"])
        settings.append((resource.RLIMIT_NPROC, threads, threads))
    elif int(limits["max_processes"]) > 1:
        raise SetupError(
            "Limits.max_processes > 1 needs a uid of the snippet's own "
            "(a root worker, or user namespaces): the worker's uid cannot be capped"
        )
    for which, soft, hard in settings:
        try:
            resource.setrlimit(which, (soft, hard))
        except (OSError, ValueError) as exc:
            raise SetupError(f"cannot set resource limit {which}: {exc}") from exc
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_IGN)  # a too-large write raises EFBIG instead
    return ["rlimits"]


# -- Landlock ---------------------------------------------------------------------------


def _landlock(workdir: str) -> list[str]:
    numbers = _SYS_LANDLOCK.get(os.uname().machine)
    if numbers is None:
        return []
    create, add_rule, restrict = numbers
    abi = _libc.syscall(create, None, 0, _LANDLOCK_CREATE_RULESET_VERSION)
    if abi < 1:
        return []
    write = _FS_WRITE_FILE | _FS_WRITE_DIR_ONLY
    write |= (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    write |= _FS_IOCTL_DEV if abi >= 5 else 0
    read = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
    file_rights = _FS_EXECUTE | _FS_READ_FILE | _FS_WRITE_FILE | (_FS_TRUNCATE if abi >= 3 else 0)
    attr = _RulesetAttr(handled_access_fs=read | write)
    size, layers = 8, ["landlock-fs"]
    if abi >= 4:
        attr.handled_access_net = _NET_BIND_TCP | _NET_CONNECT_TCP  # no rules: none allowed
        size, layers = 16, [*layers, "landlock-net"]
    if abi >= 6:
        attr.scoped = _SCOPE_SIGNAL | _SCOPE_ABSTRACT_UNIX_SOCKET
        size, layers = 24, [*layers, "landlock-signal"]
    ruleset = _libc.syscall(create, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        raise SetupError(f"landlock_create_ruleset failed: {_errno_text()}")
    try:
        readable = {sys.base_prefix, sys.prefix, sys.exec_prefix, sys.base_exec_prefix}
        readable.add(os.path.dirname(os.path.realpath(sys.executable)))
        readable.update(_READABLE_SYSTEM_PATHS)
        rules = [(path, read) for path in sorted(readable)]
        rules += [(workdir, read | write), ("/dev/null", _FS_READ_FILE | _FS_WRITE_FILE)]
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not on this system
            try:
                if not os.path.isdir(path):
                    access &= file_rights
                rule = _PathBeneathAttr(allowed_access=access, parent_fd=fd)
                if _libc.syscall(add_rule, ruleset, _LANDLOCK_RULE_PATH_BENEATH,
                                 ctypes.byref(rule), 0) != 0:  # fmt: skip
                    raise SetupError(f"landlock_add_rule({path}) failed: {_errno_text()}")
            finally:
                os.close(fd)
        if _libc.syscall(restrict, ruleset, 0) != 0:
            raise SetupError(f"landlock_restrict_self failed: {_errno_text()}")
    finally:
        os.close(ruleset)
    return layers


# -- Capabilities -----------------------------------------------------------------------


def _capabilities() -> tuple[int, int]:
    with open("/proc/self/status") as handle:
        status = dict(line.split(":", 1) for line in handle if ":" in line)
    return int(status.get("CapEff", "0").strip(), 16), int(status.get("CapPrm", "0").strip(), 16)


def _drop_bounding_set() -> None:
    """Empty the bounding and ambient sets (needs CAP_SETPCAP: before dropping the uid)."""
    if _capabilities() == (0, 0):
        return
    for cap in range(64):
        _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last cap: ignored
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)


def _drop_capabilities() -> list[str]:
    """Drop every capability left (those of a new user namespace, a root worker's)."""
    if _capabilities() != (0, 0):
        header = _CapHeader(version=0x20080522, pid=0)  # _LINUX_CAPABILITY_VERSION_3
        data = (_CapData * 2)()
        if _libc.capset(ctypes.byref(header), data) != 0:
            raise SetupError(f"capset failed: {_errno_text()}")
    if _capabilities() != (0, 0):
        raise SetupError("capabilities are left after dropping them")
    return ["no-caps"]


# -- Seccomp ----------------------------------------------------------------------------


def _install_seccomp(program: bytes) -> list[str]:
    """Load the allowlist the worker built (:mod:`._seccomp`): the last step."""
    if not program or len(program) % 8 or len(program) // 8 > 0xFFFF:
        raise SetupError(f"malformed seccomp program ({len(program)} bytes)")
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise SetupError(f"seccomp filter refused: {_errno_text()}")
    return ["seccomp-allowlist"]


# -- Running the snippet ----------------------------------------------------------------

_NETWORK_EVENTS = frozenset(
    {"socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo",
     "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"}
)  # fmt: skip
_PROCESS_EVENTS = frozenset(
    {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
     "os.exec", "os.kill", "os.killpg", "signal.pthread_kill"}
)  # fmt: skip
_attempted: set[str] = set()


def _audit(event: str, args: tuple[Any, ...]) -> None:
    """Remember what the snippet tried, only to name the reason of a failure well.

    This is no security boundary (ctypes bypasses it); the kernel layers are.
    """
    if event in _NETWORK_EVENTS:
        _attempted.add("network")
    elif event in _PROCESS_EVENTS:
        _attempted.add("process")


def _snippet_traceback(exc: BaseException) -> str:
    import traceback  # only when the snippet failed: start-up stays short

    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return text[-_MAX_ERROR_CHARS:]


def _classify(exc: BaseException) -> tuple[str, str]:
    """(status, reason) of an exception that escaped the snippet."""
    if isinstance(exc, MemoryError):
        return "memory", "memory limit reached (MemoryError)"
    if isinstance(exc, RecursionError):
        return "error", "recursion limit reached"
    if isinstance(exc, RuntimeError) and "new thread" in str(exc):
        return "forbidden", "thread limit reached (Limits.max_threads)"
    if isinstance(exc, OSError):
        code = exc.errno
        if code == errno.EFBIG:
            return "forbidden", "file size limit reached"
        if code in (errno.ENOSPC, errno.EDQUOT):
            return "disk", "disk limit reached (Limits.max_disk_bytes or Limits.max_files)"
        if code in (errno.EMFILE, errno.ENFILE):
            return "forbidden", "open files limit reached"
        if code == errno.ENOMEM:
            return "memory", "memory limit reached (ENOMEM)"
        if "network" in _attempted:
            return "forbidden", "network access is not available in the sandbox"
        if code == errno.EAGAIN and "process" in _attempted:
            return "forbidden", "process limit reached"
        if code in (errno.EPERM, errno.EACCES):
            reason = "operation not permitted in the sandbox"
            if "process" in _attempted:
                reason = "starting or signalling other processes is not permitted"
            return "forbidden", reason
    return "error", "the snippet raised an exception"


def _run_snippet(source: str, payload_text: bytes) -> dict[str, Any]:
    try:
        payload = _loads(payload_text)
        code = compile(source, "snippet.py", "exec")
        namespace: dict[str, Any] = {"__name__": "__snippet__", "__file__": "snippet.py"}
        sys.addaudithook(_audit)
        exec(code, namespace)  # noqa: S102 - running it is the point; the kernel confines it
        main = namespace.get("main")
        if not callable(main):
            return {"status": "error", "error": "the snippet defines no main(payload) function"}
        output = main(payload)
    except (KeyboardInterrupt, SystemExit) as exc:
        return {"status": "error", "error": f"the snippet exited ({exc!r})"}
    except BaseException as exc:
        status, reason = _classify(exc)
        return {"status": status, "error": f"{reason}\n{_snippet_traceback(exc)}"}
    try:
        _dumps(output)
    except (TypeError, ValueError) as exc:
        return {"status": "error", "error": f"main() returned data that is not JSON: {exc}"}
    except RecursionError:
        return {"status": "error", "error": "main() returned data nested too deeply"}
    return {"status": "ok", "output": output}


def _peak_rss() -> int:
    """This process's peak resident memory (``VmHWM``), 0 when it cannot be read."""
    try:
        with open("/proc/self/status", "rb") as handle:
            for line in handle:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class _Strict:
    """What ``_json.make_scanner`` reads from its context (json.JSONDecoder's attributes)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    memo: dict[str, Any] = {}  # noqa: RUF012

    @staticmethod
    def parse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")


_scan = _json.make_scanner(_Strict())  # type: ignore[arg-type]
_JSON_SPACE = " \t\n\r"


def _loads(text: str | bytes) -> Any:
    """``json.loads``, strict (no NaN/Infinity), without importing json."""
    if isinstance(text, bytes):
        text = text.decode()
    text = text.strip(_JSON_SPACE)
    try:
        value, end = _scan(text, 0)
    except StopIteration as exc:
        raise ValueError(f"not JSON at {exc.value}") from None
    if end != len(text):
        raise ValueError(f"extra data after JSON at {end}")
    return value


def _not_json(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _dumps(value: Any) -> str:
    """``json.dumps(value, allow_nan=False)``, without importing json."""
    encode = _json.make_encoder(
        {}, _not_json, _json.encode_basestring_ascii, None, ": ", ", ", False, False, False
    )
    return "".join(encode(value, 0))


def _write_line(fd: int, document: dict[str, Any]) -> None:
    data = (_dumps(document) + "\n").encode()
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _read_stdin() -> tuple[bytes, bytes]:
    """(seccomp program, payload): a 4-byte big-endian length, the program, the payload."""
    stdin = sys.stdin.buffer
    size = int.from_bytes(stdin.read(4), "big")
    program = stdin.read(size)
    if len(program) != size:
        raise SetupError("the seccomp program was cut short")
    return program, stdin.read()


def main() -> int:
    """Set up the sandbox from ``sys.argv[1]`` (JSON), then run the snippet."""
    try:
        config = _loads(sys.argv[1])
        workdir, limits = str(config["workdir"]), dict(config["limits"])
        # Started in "/" with neither HOME nor TMPDIR naming the private directory: until the
        # line above this process was dumpable (the interpreter's start-up).
        os.chdir(workdir)
        os.environ.update(HOME=workdir, TMPDIR=workdir)
        with open(os.path.join(workdir, "snippet.py"), encoding="utf-8") as handle:
            source = handle.read()
        program, payload_text = _read_stdin()
        result_fd = os.dup(1)  # the result channel; the snippet's fd 1 becomes stderr
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        off = set(config.get("off", ()))  # tests switch layers off to prove the others
        layers, ident = _own_namespaces(workdir, limits, off, dict(config.get("places", {})))
        if "disk-quota" in layers:  # the file is under the tmpfs now: tracebacks read it
            try:
                with open("snippet.py", "w", encoding="utf-8") as handle:
                    handle.write(source)
            except OSError:  # above the disk limit itself: tracebacks show no source lines
                pass
        if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise SetupError(f"PR_SET_NO_NEW_PRIVS failed: {_errno_text()}")
        layers += [] if "landlock" in off else _landlock(workdir)
        _check_file_wall(layers)
        _drop_bounding_set()
        if ident is not None:
            layers += _drop_to(ident)
        layers += _drop_capabilities()
        layers += _set_rlimits(limits, own_uid="own-uid" in layers)
        _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # again: the uid's change set suid_dumpable
        if _libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise SetupError("the launcher is still dumpable: its /proc entries would be open")
        layers.append("nondumpable")
        if "seccomp" not in off:
            layers += _install_seccomp(program)
        _write_line(result_fd, {"layers": layers})
    except UncontainedError as exc:
        print(exc, file=sys.stderr)
        return UNCONTAINED
    except (SetupError, OSError, ValueError, KeyError, IndexError) as exc:
        print(f"sandbox setup failed: {exc}", file=sys.stderr)
        return SETUP_FAILED
    outcome = _run_snippet(source, payload_text)
    _write_line(result_fd, {**outcome, "max_rss_bytes": _peak_rss()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
