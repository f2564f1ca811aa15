"""The sandbox's system-call allowlist, built with libseccomp (via ``pyseccomp``).

Deny by default: a call that is not listed here fails with ``EPERM``. The worker builds
the filter once per ``max_processes`` with a placeholder pid (libseccomp, exported as
classic BPF), and for each child writes that child's pid over the placeholder's
constants (the program is otherwise the same byte for byte, which a test checks); the
child loads it as the last step of its set-up (:mod:`._child`), which needs
nothing but the standard library.

The list is what a CPython interpreter running the standard library needs (file I/O
on descriptors it may open, memory, time, threads, its own signals, ``AF_UNIX``
stream socket pairs for ``asyncio``), minus everything that reaches another process or
state shared with it: ``socketpair`` makes ``AF_UNIX`` ``SOCK_STREAM`` pairs only (a datagram
or seqpacket socket could ``sendto`` any path or abstract name, descriptors included), and
``sendto`` takes no address. Calls that can name another process are allowed only on the snippet
itself: ``prlimit64``, ``{get,set}priority``, ``sched_*``, ``ioprio_*``, ``getpgid``,
``getsid`` with pid 0 or its own pid; ``kill`` to itself or its own process group
(``0``, ``pid``, ``-pid``); ``tgkill``/``rt_{tg,}sigqueueinfo`` to its own thread
group. ``fcntl``, ``ioctl`` and ``prctl`` are allowed only for the listed commands
(no ``F_SETOWN``/``F_SETSIG``/``F_SETLEASE``/``F_NOTIFY``, no ``FIOSETOWN``/``TIOCSTI``).
Not listed, so refused: ``socket``/``connect``/``bind``, System V IPC and POSIX message
queues, ``ptrace``, ``process_vm_*``, ``pidfd_*``, ``perf_event_open``, ``keyctl``,
``bpf``, ``mount`` and the new mount API, ``unshare``/``setns``, ``execve``,
``setuid``-family, ``chown``-family, ``mknod``, ``memfd_create``, ``userfaultfd``,
``io_uring_*``, ``inotify``/``fanotify``, ``mlock``, ``seccomp`` itself, and every call
added to the kernel after this list was written. ``clone3`` fails with ``ENOSYS`` so that
the C library falls back to ``clone``, whose flags can be checked: threads only (or
processes when ``Limits.max_processes > 1``), never new namespaces or ``CLONE_PARENT``.
A call made with another architecture's calling convention (e.g. ``int 0x80`` or x32 on
x86_64) kills the child (status ``forbidden``).
"""

from __future__ import annotations

import errno
import functools
import os
import struct
from typing import Final

import pyseccomp as seccomp  # type: ignore[import-untyped]

__all__ = ["ALLOWED", "build_filter", "compile_filter"]

#: Stands for the child's pid in the cached program: above the kernel's PID_MAX_LIMIT
#: (2**22), so no real pid or other constant of the rules equals it.
PLACEHOLDER_PID: Final = 0x3FFFFFF1
_PID_LIMIT = 1 << 22

#: Allowed whatever the arguments.
ALLOWED: Final[tuple[str, ...]] = (
    # memory of its own
    "brk", "mmap", "munmap", "mremap", "mprotect", "madvise", "msync",
    # descriptors it holds or may open (Landlock and file permissions decide which)
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev",
    "preadv2", "pwritev2", "lseek", "open", "openat", "openat2", "creat", "close",
    "close_range", "dup", "dup2", "dup3", "stat", "fstat", "lstat", "newfstatat", "statx",
    "statfs", "fstatfs", "access", "faccessat", "faccessat2", "readlink", "readlinkat",
    "getdents", "getdents64", "getcwd", "chdir", "fchdir", "mkdir", "mkdirat", "rmdir",
    "unlink", "unlinkat", "rename", "renameat", "renameat2", "link", "linkat", "symlink",
    "symlinkat", "chmod", "fchmod", "fchmodat", "truncate", "ftruncate", "fallocate",
    "fsync", "fdatasync", "fadvise64", "readahead", "utime", "utimes", "utimensat",
    "futimesat", "sendfile", "copy_file_range", "umask", "getxattr", "lgetxattr",
    "fgetxattr", "listxattr", "llistxattr", "flistxattr", "pipe", "pipe2",
    "select", "pselect6", "poll", "ppoll", "epoll_create", "epoll_create1", "epoll_ctl",
    "epoll_wait", "epoll_pwait", "epoll_pwait2", "eventfd", "eventfd2",
    # operations on the AF_UNIX stream pairs it made (socket() and connect() are not
    # listed; sendto only without an address, below; a stream socket refuses sendmsg with
    # one: EISCONN)
    "recvfrom", "sendmsg", "recvmsg", "shutdown", "getsockname", "getpeername",
    "getsockopt", "setsockopt",
    # time
    "clock_gettime", "clock_getres", "clock_nanosleep", "nanosleep", "gettimeofday",
    "time", "alarm", "setitimer", "getitimer", "timer_create", "timer_settime",
    "timer_gettime", "timer_getoverrun", "timer_delete", "timerfd_create",
    "timerfd_settime", "timerfd_gettime",
    # its own signal handling
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigtimedwait",
    "rt_sigsuspend", "sigaltstack", "pause", "signalfd", "signalfd4", "restart_syscall",
    # threads and facts about itself
    "futex", "futex_waitv", "set_robust_list", "set_tid_address", "rseq", "arch_prctl",
    "sched_yield", "sched_get_priority_max", "sched_get_priority_min", "getpid", "gettid",
    "getppid", "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid",
    "getgroups", "getpgrp", "uname", "sysinfo", "getrandom", "getrusage", "times",
    "getcpu", "getrlimit", "setrlimit", "exit", "exit_group", "wait4", "waitid",
)  # fmt: skip

#: Allowed when the first argument is 0 (the caller) or the snippet's pid.
SELF_ONLY: Final[tuple[str, ...]] = (
    "prlimit64", "sched_setaffinity", "sched_getaffinity", "sched_setscheduler",
    "sched_getscheduler", "sched_setparam", "sched_getparam", "sched_setattr",
    "sched_getattr", "sched_rr_get_interval", "getpgid", "getsid",
)  # fmt: skip

#: ``fcntl`` commands: descriptor flags, status flags (``O_ASYNC`` is harmless without
#: an owner), record locks, seals. Not ``F_SETOWN`` (8), ``F_SETSIG`` (10),
#: ``F_SETOWN_EX`` (15), ``F_SETLEASE`` (1024), ``F_NOTIFY`` (1026), ``F_SETPIPE_SZ``.
FCNTL_COMMANDS: Final[tuple[int, ...]] = (
    0, 1, 2, 3, 4, 5, 6, 7,  # F_DUPFD, F_GETFD, F_SETFD, F_GETFL, F_SETFL, F_GETLK, F_SETLK(W)
    9, 11, 16,  # F_GETOWN, F_GETSIG, F_GETOWN_EX (read only)
    36, 37, 38,  # F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW
    1030, 1032, 1033, 1034,  # F_DUPFD_CLOEXEC, F_GETPIPE_SZ, F_ADD_SEALS, F_GET_SEALS
)  # fmt: skip

#: ``ioctl`` requests: terminal queries (``isatty``), ``FIONREAD``, ``FIONBIO``,
#: ``FIOCLEX``/``FIONCLEX``. Not ``FIOSETOWN``/``SIOCSPGRP``/``FIOASYNC`` (signal another
#: process, like ``F_SETOWN``) nor ``TIOCSTI`` (type into a terminal).
IOCTL_REQUESTS: Final[tuple[int, ...]] = (0x5401, 0x5413, 0x541B, 0x5421, 0x5450, 0x5451)

#: ``prctl`` options: its name, its dumpable flag (read), seccomp/no_new_privs (read),
#: the capability bounding set (read), ``PR_SET_VMA`` (the C library names mappings).
PRCTL_OPTIONS: Final[tuple[int, ...]] = (3, 15, 16, 21, 23, 39, 0x53564D41)

_AF_UNIX = 1
_SOCK_STREAM = 1
_SOCK_TYPE_MASK = 0xF  # the rest of socketpair's type: SOCK_NONBLOCK, SOCK_CLOEXEC
_PRIO_PROCESS = 0
_IOPRIO_WHO_PROCESS = 1
_CLONE_THREAD = 0x00010000
_CLONE_PARENT = 0x00008000
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_CLONE_NAMESPACES = 0x7E020000


def _add(flt: seccomp.SyscallFilter, action: int, name: str, *args: seccomp.Arg) -> None:
    """One rule; a call this libseccomp does not know cannot be allowed (so stays denied)."""
    if seccomp.resolve_syscall(seccomp.Arch.NATIVE, name) == -1:  # __NR_SCMP_ERROR
        return
    flt.add_rule(action, name, *args)


def build_filter(pid: int, max_processes: int) -> bytes:
    """The BPF program (``struct sock_filter`` array) for the child ``pid``: the cached
    program of :func:`compile_filter` with ``pid`` written over the placeholder.

    Parameters:
      pid(int): the child's pid, which is also its process group and session id.
      max_processes(int): ``Limits.max_processes``; with 1, only threads may be cloned.
    """
    if not 0 < pid < _PID_LIMIT:
        raise ValueError(f"pid {pid} is out of range")
    program = bytearray(_cached(min(max_processes, 2)))
    replace = {PLACEHOLDER_PID: pid, -PLACEHOLDER_PID & 0xFFFFFFFF: -pid & 0xFFFFFFFF}
    patched = 0
    for offset in range(0, len(program), 8):
        code, jt, jf, k = struct.unpack_from("=HBBI", program, offset)
        if k in replace:
            struct.pack_into("=HBBI", program, offset, code, jt, jf, replace[k])
            patched += 1
    if not patched:
        raise OSError(errno.EINVAL, "no pid placeholder in the seccomp program")
    return bytes(program)


@functools.lru_cache(maxsize=2)
def _cached(max_processes: int) -> bytes:
    return compile_filter(PLACEHOLDER_PID, max_processes)


def compile_filter(pid: int, max_processes: int) -> bytes:
    """The BPF program (``struct sock_filter`` array) for the child ``pid``, built now.

    Parameters:
      pid(int): the child's pid, which is also its process group and session id.
      max_processes(int): ``Limits.max_processes``; with 1, only threads may be cloned.

    Returns:
      bytes: the program, for ``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ...)``.
    """
    allow = seccomp.ALLOW
    flt = seccomp.SyscallFilter(seccomp.ERRNO(errno.EPERM))
    flt.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    for name in ALLOWED:
        _add(flt, allow, name)
    for name in SELF_ONLY:
        for target in (0, pid):
            _add(flt, allow, name, seccomp.Arg(0, seccomp.EQ, target))
    for name in ("getpriority", "setpriority"):
        for target in (0, pid):
            _add(flt, allow, name, seccomp.Arg(0, seccomp.EQ, _PRIO_PROCESS),
                 seccomp.Arg(1, seccomp.EQ, target))  # fmt: skip
    for name in ("ioprio_get", "ioprio_set"):
        for target in (0, pid):
            _add(flt, allow, name, seccomp.Arg(0, seccomp.EQ, _IOPRIO_WHO_PROCESS),
                 seccomp.Arg(1, seccomp.EQ, target))  # fmt: skip
    # kill(pid_t) is 32 bits: -pid is compared in its low 32 bits.
    for target in (0, pid, -pid & 0xFFFFFFFF):
        _add(flt, allow, "kill", seccomp.Arg(0, seccomp.MASKED_EQ, 0xFFFFFFFF, target))
    for name in ("tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        _add(flt, allow, name, seccomp.Arg(0, seccomp.EQ, pid))
    for command in FCNTL_COMMANDS:
        _add(flt, allow, "fcntl", seccomp.Arg(1, seccomp.EQ, command))
    for request in IOCTL_REQUESTS:
        _add(flt, allow, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, request))
    for option in PRCTL_OPTIONS:
        _add(flt, allow, "prctl", seccomp.Arg(0, seccomp.EQ, option))
    # Stream pairs only: a datagram or seqpacket socket can send to any address (a
    # filesystem path, or an abstract name in the same network namespace) and pass it
    # descriptors (SCM_RIGHTS); a stream pair reaches only its other end, in the run.
    _add(flt, allow, "socketpair", seccomp.Arg(0, seccomp.EQ, _AF_UNIX),
         seccomp.Arg(1, seccomp.MASKED_EQ, _SOCK_TYPE_MASK, _SOCK_STREAM))  # fmt: skip
    _add(flt, allow, "sendto", seccomp.Arg(4, seccomp.EQ, 0))  # no destination address
    never = _CLONE_NAMESPACES | _CLONE_PARENT
    if max_processes <= 1:
        _add(flt, allow, "clone",
             seccomp.Arg(0, seccomp.MASKED_EQ, never | _CLONE_THREAD, _CLONE_THREAD))  # fmt: skip
    else:
        _add(flt, allow, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, never, 0))
        _add(flt, allow, "fork")
        _add(flt, allow, "vfork")
    _add(flt, seccomp.ERRNO(errno.ENOSYS), "clone3")  # arguments in memory: unfilterable
    fd = os.memfd_create("sandbox-seccomp", os.MFD_CLOEXEC)
    try:
        flt.export_bpf(_Fd(fd))
        return os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)


class _Fd:
    """A descriptor in the shape ``export_bpf`` wants (an object with ``fileno()``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd
