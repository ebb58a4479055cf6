"""A stack's processes end with the process that started them.

``splitserve up`` drains and stops its stack on Ctrl-C, SIGTERM or SIGHUP. Killed instead
(SIGKILL, the OOM killer, a crash), it cannot: its workers and its Redis would run on, holding
their ports and shared memory, with nothing left to stop them. So each process a `Stack` starts
asks the kernel for SIGTERM when its parent ends (``prctl(PR_SET_PDEATHSIG)``): a worker or
router then drains and removes its segments as when it is stopped, and Redis exits.

Linux sends that signal when the *thread* that started the child ends, not the process. A `Stack`
ties the processes it starts from the main thread only (one started from another thread, which
may end long before the stack, is not tied); a `ForkServer` ties its children to itself, which is
single-threaded and ends when the process that started it does (its stdin closes).

Run as a script (``python -I -S lifeline.py PARENT_PID PROGRAM ARGS...``: no site, and not its
folder on ``sys.path``), this file ties itself to its parent and then becomes ``PROGRAM``
(``execv``, which keeps the tie): how `Stack` ties a process it starts with `subprocess`, Redis
included. Linux only; elsewhere nothing is tied.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
SUPPORTED = sys.platform.startswith("linux")


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """Have ``sig`` sent to this process when its parent (thread) ends. ``parent``: the pid its parent
    had when it started this one; if that is no longer this process's parent, it has ended already,
    and ``sig`` is sent now."""
    if not SUPPORTED:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def tied(argv: list[str]) -> list[str]:
    """The command line that runs ``argv`` tied to this process (SIGTERM when it ends): ``argv`` run
    through this file. From a thread other than the main one, or off Linux: ``argv`` as it is."""
    if not SUPPORTED or threading.current_thread() is not threading.main_thread():
        return list(argv)
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), *argv]


if __name__ == "__main__":
    die_with_parent(int(sys.argv[1]))
    for name in ("SIGPIPE", "SIGXFSZ"):  # ignored by Python at its start, and an exec keeps that: as subprocess,
        if hasattr(signal, name):  # the program gets their defaults back (restore_signals)
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    os.execv(sys.argv[2], sys.argv[2:])
