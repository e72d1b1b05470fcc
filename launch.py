"""
The child processes of the launchers (sweep.py's points, quickstart.py's steps): each starts in its
own session, and all of them stop when the launcher is stopped (SIGTERM, Ctrl-C, a closed
terminal) or, on Linux, killed, so no training outlives its launcher to hold a run folder
(die_with_parent also ties prepare_data.py's pool workers to it).
"""

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from interrupt import Interrupted


# The running child processes (a sweep's points, the quickstart's steps), for stop_children. Each
# runs in its own session (process group): a signal sent to the launcher's group (Ctrl-C in a
# terminal) does not reach them half-way through a checkpoint; the launcher stops each group as a
# whole, itself.
CHILDREN, CHILDREN_LOCK, STOPPING = set(), threading.Lock(), threading.Event()
LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # kill PID, Ctrl-C, a closed terminal


def die_with_parent():
    """A request for a forked child to run first (Linux; None elsewhere): before a launcher's child
    execs, or as a pool worker starts. The child gets SIGTERM when the thread that forked it dies,
    which covers a SIGKILLed parent, the one death no handler sees. A parent that died before the
    request took effect has already orphaned the child: it exits instead."""
    parent = os.getpid()

    def request():
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)
    return request if LIBC is not None else None


def start_child(cmd, **popen):
    """subprocess.Popen(cmd, **popen) in its own session, known to stop_children until end_child.
    Nothing starts once the launcher is stopping."""
    with CHILDREN_LOCK:  # with stop_children's, so no child starts unseen by it
        if STOPPING.is_set():
            raise RuntimeError("stopping: no new process starts")
        proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent(), **popen)
        CHILDREN.add(proc)
    return proc


def end_child(proc):
    """proc's exit code, once it has ended. Not in a finally: a child whose waiter was cut short
    (Stopped, raised in the main thread) must stay known to stop_children."""
    code = proc.wait()
    with CHILDREN_LOCK:
        CHILDREN.discard(proc)
    return code


def stop_children(grace_s=600):
    """SIGTERM every running child's process group, SIGKILL what still runs after grace_s, and
    wait for them: a stopped launcher leaves no training behind to hold a run folder. A training
    takes SIGTERM as a preemption notice (train.py): it finishes its step and saves it, which for
    a large model takes minutes, so the grace is long; other children end at once."""
    STOPPING.set()
    with CHILDREN_LOCK:
        running = list(CHILDREN)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in running:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:  # ended already
                pass
        deadline = time.time() + grace_s
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        running = [proc for proc in running if proc.returncode is None]
        if not running:
            return


class Stopped(BaseException):
    """One of STOP_SIGNALS arrived: raised in the main thread wherever it was (stoppable). Not an
    Exception, so no `except Exception` on the way catches it."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def stoppable(main, stopped_line):
    """main() with STOP_SIGNALS stopping it: the children still running when it ends in any exception are
    stopped and waited for (no orphan keeps training), and a signal ends it in Interrupted, whose line is
    stopped_line.format(signal=its name) and status the shell's 128 + its number. Only the first signal raises:
    a second Ctrl-C can't cut the stopping of the children short."""
    stopping = []  # not empty once a signal has arrived or main() has ended in an exception

    def stop(signum, frame):
        if not stopping:
            stopping.append(signum)
            raise Stopped(signum)
    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)
    try:
        main()
    except BaseException as e:
        stopping.append(e)  # a signal from here on is absorbed
        stop_children()
        if not isinstance(e, Stopped):
            raise
        raise Interrupted(stopped_line.format(signal=signal.Signals(e.signum).name), e.signum) from None


@contextmanager
def child_pool(jobs):
    """A ThreadPoolExecutor whose threads wait on children: on an exception (Stopped) its exit, which
    waits for the threads, would wait for their children to end by themselves; they are stopped first."""
    with ThreadPoolExecutor(jobs) as pool:
        try:
            yield pool
        except BaseException:
            stop_children()
            raise
