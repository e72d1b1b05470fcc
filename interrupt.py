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


def started():
    """Ctrl-C is Python's KeyboardInterrupt again, which the tool's main turns into its own line."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
