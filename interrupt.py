"""
A tool's process from its start to its exit status, shared by train.py, eval.py, bench.py, prepare_data.py,
sweep.py and quickstart.py: Ctrl-C while starting and while running, a scheduler's notice to stop, bad input as
one line, and the process group closed on every way out.

    if __name__ == "__main__":
        interrupt.while_starting("tool: interrupted while starting, ...")   # before the slow imports
    ...
    if __name__ == "__main__":
        interrupt.run(main, "tool: interrupted; ...", errors=(ValueError,), line=lambda e: f"tool: {e}")

Imports only the standard library: torch and the project's modules take seconds to import, and a Ctrl-C then
must already be one line.
"""
import gc
import os
import signal
import sys
import threading
from contextlib import contextmanager


def while_starting(line):
    """Until run() starts main: SIGINT prints line and ends the process at once with 128 + SIGINT (a
    KeyboardInterrupt would come out of whichever import it cut short, as a traceback)."""
    def interrupted(signum, frame):
        print(line, file=sys.stderr, flush=True)
        os._exit(128 + signum)  # nothing is written yet, and an extension module's half-run init need not unwind
    signal.signal(signal.SIGINT, interrupted)


class Stop(Exception):
    """A tool's own end: one line (the exception's text) and its exit status."""
    status = 1


class Interrupted(Stop):
    """Ctrl-C, or a signal a tool treats like it: one line saying what was left and how to go on."""

    def __init__(self, line, signum=signal.SIGINT):
        super().__init__(line)
        self.status = 128 + signum


# SIGTERM and SIGUSR1 are a scheduler's notice that it will kill the job (SLURM's scancel and --signal,
# Kubernetes, spot instances): a run finishes its step, saves it, and exits with PREEMPTED_STATUS (sysexits'
# EX_TEMPFAIL, "try again later"), which a job script requeues on.
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_STATUS = 75


class Preempted(Stop):
    """A notice of PREEMPT_SIGNALS during training: the step was saved; one line names it."""
    status = PREEMPTED_STATUS


def run(main, interrupted, errors=(), line=str):
    """main() as the whole process, which ends in sys.exit: main's return value if an int, else 0; a Stop's line and
    status; Ctrl-C that main did not name itself: interrupted and 130 (each line once under torchrun); an
    error of the classes in errors: line(error) and 1, no traceback; anything else: its traceback and 1.
    Once the outcome is decided, Ctrl-C is ignored, and on every way out but success (where main closed it) the
    process group is closed."""
    signal.signal(signal.SIGINT, _ctrl_c)  # from here Ctrl-C is KeyboardInterrupt, which main turns into its line
    status = 1  # main() raised what no clause below handles: its traceback, then this
    try:
        status = main()
        status = status if isinstance(status, int) else 0  # a result (eval.py's) is printed, not a status
    except (Stop, KeyboardInterrupt) as e:
        if os.environ.get("RANK", "0") == "0":  # once, not once per rank (torchrun)
            print(e if isinstance(e, Stop) else interrupted, file=sys.stderr)
        status = getattr(e, "status", 128 + signal.SIGINT)
    except errors as e:
        status = line(e)
    finally:
        decided()
        if status:  # after the except clauses: the error's traceback no longer holds the model
            close_process_group()
    sys.exit(status)


RECEIVED = []  # the Ctrl-Cs since run() started main: received() tells them from a crash


def _ctrl_c(signum, frame):
    RECEIVED.append(signum)
    signal.default_int_handler(signum, frame)


def received():
    """Whether Ctrl-C came since main started. A KeyboardInterrupt raised inside a compiled function or a C++ op
    can come out as another exception (torch's INTERNAL ASSERT, a dynamo error wrapping it): after a Ctrl-C
    a tool says its interrupted line for that too, not a traceback."""
    return bool(RECEIVED)


def decided():
    """The tool's outcome is decided (its result written, its status chosen): a Ctrl-C from here on is ignored.
    At exit Python puts its own SIGINT handler back to the default, and a Ctrl-C then would end the process
    silently (status -2) after a finished run; an ignored signal stays ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextmanager
def preemption_notices():
    """The list a preemption signal is appended to while the run trains: only marked, so that the step and
    the save in progress go on (a second signal during the save changes nothing)."""
    notices = []
    previous = {sig: signal.signal(sig, lambda signum, frame: notices.append(signum)) for sig in PREEMPT_SIGNALS}
    try:
        yield notices
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def sigint_held(deliver=True):
    """SIGINT held back for the block; yields the list of those that came. deliver: each goes, at the end, to the
    handler that was there before (a KeyboardInterrupt raised there); else the caller decides what they mean.
    A swapped handler, not a blocked signal: the kernel would hand a signal blocked in this thread to another one
    (torch's workers), whose C handler still makes Python raise it here. Only the main thread sees
    KeyboardInterrupt, so elsewhere there is nothing to hold."""
    caught = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield caught
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and deliver:
            signal.raise_signal(signal.SIGINT)


def close_process_group():
    """Destroy torch's process group, if there is one, and let go of it. A gloo group stays alive, its threads
    running, for as long as anything holds it: the model's FSDP state (kept by an error's traceback), and
    DTensor's caches (sharding propagation, redistribute plans, mesh topology), which keep the run's device
    meshes, each holding its groups. The interpreter's exit would race those threads and abort (SIGABRT, exit
    code 134) instead of exiting with the run's status. Called again once an error is handled and its frames are
    gone. Ctrl-C is held back meanwhile, for the same reason: returns whether one came (the caller's to report).
    torch is looked up, not imported: a tool that never loaded it has no group."""
    dist = sys.modules.get("torch.distributed")
    mesh = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
    if dist is None:
        return False
    with sigint_held(deliver=False) as caught:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()  # the model and optimizer: FSDP2 holds them in reference cycles
        for obj in gc.get_objects():
            if type(obj) is mesh:  # not isinstance: it would touch every object's deprecated attributes
                getattr(obj, "_pg_registry", {}).clear()
    return bool(caught)
