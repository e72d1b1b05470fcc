"""
Ctrl-C while a script is still starting: one line and the shell's 130, not a traceback.

torch and the project's modules take seconds to import, and a KeyboardInterrupt raised then comes out
of whichever import it cut short. Each tool calls while_starting() before those imports (this module
imports only the standard library), and started() once its own Ctrl-C handling is in place.
"""
import os
import signal
import sys


def while_starting(line):
    """Until started(): SIGINT prints line and ends the process at once with 128 + SIGINT."""
    def interrupted(signum, frame):
        print(line, file=sys.stderr, flush=True)
        os._exit(128 + signum)  # nothing is written yet, and an extension module's half-run init need not unwind
    signal.signal(signal.SIGINT, interrupted)


RECEIVED = []  # the Ctrl-Cs since started(): received() tells them from a crash


def started():
    """Ctrl-C is Python's KeyboardInterrupt again, which the tool's main turns into its own line."""
    signal.signal(signal.SIGINT, interrupted)


def interrupted(signum, frame):
    RECEIVED.append(signum)
    signal.default_int_handler(signum, frame)


def received():
    """Whether Ctrl-C came since started(). A KeyboardInterrupt raised inside a compiled function or a C++ op
    can come out as another exception (torch's INTERNAL ASSERT, a dynamo error wrapping it): after a Ctrl-C
    a tool says its interrupted line for that too, not a traceback."""
    return bool(RECEIVED)


def decided():
    """The tool's outcome is decided (its result written, its status chosen): a Ctrl-C from here on is ignored.
    At exit Python puts its own SIGINT handler back to the default, and a Ctrl-C then would end the process
    silently (status -2) after a finished run; an ignored signal stays ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
