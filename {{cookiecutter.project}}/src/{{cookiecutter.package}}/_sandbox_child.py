"""The launcher that :func:`.sandbox.run_untrusted` executes as the sandbox child.

It runs as ``python -I -S _sandbox_child.py <config>`` (standard library only, never
imported by the worker), confines itself and then runs the customer's snippet:

1. reads the payload (JSON) from stdin and keeps a private copy of stdout for the
   result; the snippet's own ``print`` output goes to stderr;
2. enters a new network namespace when the kernel lets it (``netns``);
3. sets ``no_new_privs`` and applies Landlock where the kernel has it: writes only
   under the private working directory, reads only from the Python installation,
   system libraries and the working directory (``landlock-fs``), no TCP bind or
   connect (``landlock-net``), no signals to processes outside the sandbox
   (``landlock-signal``);
4. drops every capability (``no-caps``, matters only when started as root);
5. sets the resource limits (``rlimits``);
6. installs a seccomp filter: no sockets (``seccomp-net``); no fork, no signals to
   other processes, no ptrace, io_uring, namespaces, mounts or new sessions
   (``seccomp-proc``);
7. writes one JSON line ``{"layers": [...]}`` to the result channel, runs
   ``main(payload)`` from the snippet and writes one JSON line with the outcome.

A failure before step 7 exits with :data:`SETUP_FAILED` and a message on stderr.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import resource
import signal
import sys
import traceback
from typing import Any

SETUP_FAILED = 70
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
_CLONE_THREAD = 0x00010000
_CLONE_NAMESPACES = 0x7E020000  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET

_SECCOMP_RET_KILL_PROCESS = 0x80000000
_SECCOMP_RET_ERRNO = 0x00050000
_SECCOMP_RET_ALLOW = 0x7FFF0000
_BPF_LD_W_ABS = 0x20
_BPF_JEQ_K = 0x15
_BPF_JGE_K = 0x35
_BPF_JSET_K = 0x45
_BPF_RET_K = 0x06
_X32_SYSCALL_BIT = 0x40000000

_ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        {
            "socket": 41, "socketpair": 53, "fork": 57, "vfork": 58, "clone": 56,
            "clone3": 435, "kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129,
            "rt_tgsigqueueinfo": 297, "pidfd_send_signal": 424, "pidfd_getfd": 438,
            "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
            "process_madvise": 440, "kcmp": 312, "setsid": 112, "setpgid": 109,
            "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155,
            "chroot": 161, "open_tree": 428, "move_mount": 429, "fsopen": 430,
            "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
            "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
            "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "keyctl": 250,
            "add_key": 248, "request_key": 249, "kexec_load": 246, "kexec_file_load": 320,
            "init_module": 175, "finit_module": 313, "delete_module": 176, "reboot": 169,
            "swapon": 167, "swapoff": 168, "acct": 163, "iopl": 172, "ioperm": 173,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "socket": 198, "socketpair": 199, "clone": 220, "clone3": 435, "kill": 129,
            "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240,
            "pidfd_send_signal": 424, "pidfd_getfd": 438, "ptrace": 117,
            "process_vm_readv": 270, "process_vm_writev": 271, "process_madvise": 440,
            "kcmp": 272, "setsid": 157, "setpgid": 154, "unshare": 97, "setns": 268,
            "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "open_tree": 428,
            "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
            "fspick": 433, "mount_setattr": 442, "io_uring_setup": 425,
            "io_uring_enter": 426, "io_uring_register": 427, "bpf": 280,
            "perf_event_open": 241, "userfaultfd": 282, "keyctl": 219, "add_key": 217,
            "request_key": 218, "kexec_load": 104, "kexec_file_load": 294,
            "init_module": 105, "finit_module": 273, "delete_module": 106, "reboot": 142,
            "swapon": 224, "swapoff": 225, "acct": 89,
        },
    ),
}  # fmt: skip

_DENIED_EPERM = (
    "pidfd_send_signal", "pidfd_getfd", "ptrace", "process_vm_readv", "process_vm_writev",
    "process_madvise", "kcmp", "setsid", "setpgid", "unshare", "setns", "mount", "umount2",
    "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key",
    "request_key", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "reboot", "swapon", "swapoff", "acct", "iopl", "ioperm",
)  # fmt: skip
_DENIED_ENOSYS = ("clone3", "io_uring_setup", "io_uring_enter", "io_uring_register")

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


class SetupError(Exception):
    """The sandbox could not be set up; nothing of the snippet has run."""


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [
        ("len", ctypes.c_ushort),
        ("filter", ctypes.POINTER(_SockFilter)),
    ]


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


# -- Network namespace ----------------------------------------------------------------


def _enter_network_namespace() -> list[str]:
    """A new, empty network namespace (only a down loopback) when the kernel allows it."""
    if _libc.unshare(_CLONE_NEWNET) == 0:  # needs CAP_SYS_ADMIN: root outside a pod
        return ["netns"]
    uid, gid = os.geteuid(), os.getegid()
    if _libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        return []  # typical for a restricted pod: seccomp RuntimeDefault forbids it
    try:  # map our own ids, or files can no longer be created (EOVERFLOW)
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1")):
            with open(f"/proc/self/{name}", "w") as handle:
                handle.write(text)
        with open("/proc/self/gid_map", "w") as handle:
            handle.write(f"{gid} {gid} 1")
    except OSError as exc:
        raise SetupError(f"cannot map ids in the new user namespace: {exc}") from exc
    return ["netns", "userns"]


# -- Resource limits --------------------------------------------------------------------


def _set_rlimits(limits: dict[str, Any]) -> list[str]:
    cpu = int(limits["cpu_seconds"])
    settings = [
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL at hard
        (resource.RLIMIT_AS, int(limits["memory_bytes"]), int(limits["memory_bytes"])),
        (resource.RLIMIT_NPROC, int(limits["max_processes"]), int(limits["max_processes"])),
        (resource.RLIMIT_NOFILE, int(limits["max_open_files"]), int(limits["max_open_files"])),
        (resource.RLIMIT_FSIZE, int(limits["max_file_bytes"]), int(limits["max_file_bytes"])),
    ]
    for which, soft, hard in settings:
        try:
            resource.setrlimit(which, (soft, hard))
        except (OSError, ValueError) as exc:
            raise SetupError(f"cannot set resource limit {which}: {exc}") from exc
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large write raises EFBIG instead
    return ["rlimits"]


# -- Landlock ---------------------------------------------------------------------------


def _landlock(workdir: str) -> list[str]:
    numbers = _SYS_LANDLOCK.get(platform.machine())
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


def _drop_capabilities() -> list[str]:
    """Drop every capability: only changes anything when the worker runs as root."""
    with open("/proc/self/status") as handle:
        status = dict(line.split(":", 1) for line in handle if ":" in line)
    if (
        int(status.get("CapEff", "0").strip(), 16) == 0
        and int(status.get("CapPrm", "0").strip(), 16) == 0
    ):
        return []
    for cap in range(64):
        _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last cap: ignored
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = _CapHeader(version=0x20080522, pid=0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    if _libc.capset(ctypes.byref(header), data) != 0:
        raise SetupError(f"capset failed: {_errno_text()}")
    return ["no-caps"]


# -- Seccomp ----------------------------------------------------------------------------


def _stmt(code: int, k: int) -> tuple[int, int, int, int]:
    return (code, 0, 0, k & 0xFFFFFFFF)


def _jump(code: int, k: int, jt: int, jf: int) -> tuple[int, int, int, int]:
    return (code, jt, jf, k & 0xFFFFFFFF)


def _syscall_block(nr: int, body: list[tuple[int, int, int, int]]) -> list[tuple[int, ...]]:
    """``if nr == NR: body`` (the body always ends in a return)."""
    return [_jump(_BPF_JEQ_K, nr, 0, len(body)), *body]


def _allow_if_arg0_in(values: list[int]) -> list[tuple[int, int, int, int]]:
    eperm = _stmt(_BPF_RET_K, _SECCOMP_RET_ERRNO | errno.EPERM)
    body = [_stmt(_BPF_LD_W_ABS, 16)]  # low 32 bits of args[0] (little endian)
    body += [_jump(_BPF_JEQ_K, v, len(values) - i, 0) for i, v in enumerate(values)]
    return [*body, eperm, _stmt(_BPF_RET_K, _SECCOMP_RET_ALLOW)]


def _seccomp_program(max_processes: int) -> list[tuple[int, ...]]:
    machine = platform.machine()
    if machine not in _ARCHES or sys.byteorder != "little":
        raise SetupError(f"no seccomp filter for architecture {machine}")
    audit_arch, nrs = _ARCHES[machine]
    pid = os.getpid()  # the session leader; pgid == pid
    eperm = _stmt(_BPF_RET_K, _SECCOMP_RET_ERRNO | errno.EPERM)
    enosys = _stmt(_BPF_RET_K, _SECCOMP_RET_ERRNO | errno.ENOSYS)
    program: list[tuple[int, ...]] = [
        _stmt(_BPF_LD_W_ABS, 4),  # seccomp_data.arch
        _jump(_BPF_JEQ_K, audit_arch, 1, 0),
        _stmt(_BPF_RET_K, _SECCOMP_RET_KILL_PROCESS),
        _stmt(_BPF_LD_W_ABS, 0),  # seccomp_data.nr
    ]
    if machine == "x86_64":  # the x32 ABI would bypass the numbers below
        program += [_jump(_BPF_JGE_K, _X32_SYSCALL_BIT, 0, 1), enosys]
    program += _syscall_block(nrs["socket"], [eperm])
    for name in ("kill", "rt_sigqueueinfo"):  # self, own group (0 or -pgid) only
        program += _syscall_block(nrs[name], _allow_if_arg0_in([pid, 0, -pid]))
    for name in ("tkill", "tgkill", "rt_tgsigqueueinfo"):
        program += _syscall_block(nrs[name], _allow_if_arg0_in([pid]))
    clone = [_stmt(_BPF_LD_W_ABS, 16), _jump(_BPF_JSET_K, _CLONE_NAMESPACES, 0, 1), eperm]
    if max_processes <= 1:  # threads only
        clone += [_jump(_BPF_JSET_K, _CLONE_THREAD, 1, 0), eperm]
        for name in ("fork", "vfork"):
            if name in nrs:
                program += _syscall_block(nrs[name], [eperm])
    program += _syscall_block(nrs["clone"], [*clone, _stmt(_BPF_RET_K, _SECCOMP_RET_ALLOW)])
    for name in _DENIED_EPERM:
        if name in nrs:
            program += _syscall_block(nrs[name], [eperm])
    for name in _DENIED_ENOSYS:
        program += _syscall_block(nrs[name], [enosys])
    program.append(_stmt(_BPF_RET_K, _SECCOMP_RET_ALLOW))
    return program


def _install_seccomp(max_processes: int) -> list[str]:
    program = _seccomp_program(max_processes)
    filters = (_SockFilter * len(program))(*[_SockFilter(*insn) for insn in program])
    fprog = _SockFprog(len(program), filters)
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise SetupError(f"seccomp filter refused: {_errno_text()}")
    return ["seccomp-net", "seccomp-proc"]


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
    if isinstance(exc, OSError):
        code = exc.errno
        if code == errno.EFBIG:
            return "forbidden", "file size limit reached"
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
        payload = json.loads(payload_text)
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
        json.dumps(output, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return {"status": "error", "error": f"main() returned data that is not JSON: {exc}"}
    return {"status": "ok", "output": output}


def _write_line(fd: int, document: dict[str, Any]) -> None:
    data = (json.dumps(document, allow_nan=False) + "\n").encode()
    while data:
        written = os.write(fd, data)
        data = data[written:]


def main() -> int:
    """Set up the sandbox from ``sys.argv[1]`` (JSON), then run the snippet."""
    try:
        config = json.loads(sys.argv[1])
        workdir, limits = str(config["workdir"]), dict(config["limits"])
        with open(os.path.join(workdir, "snippet.py"), encoding="utf-8") as handle:
            source = handle.read()
        payload_text = sys.stdin.buffer.read()
        result_fd = os.dup(1)  # the result channel; the snippet's fd 1 becomes stderr
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        off = set(config.get("off", ()))  # tests switch layers off to prove the others
        layers = [] if "netns" in off else _enter_network_namespace()
        if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise SetupError(f"PR_SET_NO_NEW_PRIVS failed: {_errno_text()}")
        layers += [] if "landlock" in off else _landlock(workdir)
        layers += _drop_capabilities()
        layers += _set_rlimits(limits)
        if "seccomp" not in off:
            layers += _install_seccomp(int(limits["max_processes"]))
        _write_line(result_fd, {"layers": layers})
    except (SetupError, OSError, ValueError, KeyError, IndexError) as exc:
        print(f"sandbox setup failed: {exc}", file=sys.stderr)
        return SETUP_FAILED
    _write_line(result_fd, _run_snippet(source, payload_text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
