"""One clear line when a command's process is ended by a fatal signal (SIGABRT above all: XLA aborts a process whose
collective waited past its limit, 40 s on CPUs), after XLA's own log: what happened and what to do next.

An aborting process runs no more Python: the signal ends it from the thread where XLA gave up. So the line comes from
a watcher, a small child process reading a pipe. ``faulthandler`` writes its report of a fatal signal into that pipe
(``Fatal Python error: Aborted`` and the threads' Python stacks); the watcher prints the command's line on the
inherited stderr, after the report itself where ``faulthandler`` was already on (``python -X faulthandler``, pytest).
At any other end (an exit, Ctrl-C, SIGKILL) the pipe closes with nothing in it and the watcher ends without a word.
"""
from __future__ import annotations

import faulthandler
import os
import subprocess
import sys

# The watcher: ignores the terminal's Ctrl-C and a job's SIGTERM (the run handles those, and its end closes the pipe),
# reads the pipe to its end, and names the signal faulthandler reported.
_WATCHER = r"""
import re, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
report = sys.stdin.buffer.read().decode(errors="replace")
found = re.search(r"Fatal Python error: ([^\n]+)", report)
if found:
    if sys.argv[2] == "echo":
        sys.stderr.write(report)
    sys.stderr.write(sys.argv[1].format(signal=found.group(1).strip()) + "\n")
"""

_installed = False


def explain_fatal_signals(line: str) -> None:
    """From now on, a fatal signal ending this process is followed on stderr by ``line`` (``{signal}`` in it becomes
    the signal's name, e.g. "Aborted"). Once per process; later calls do nothing."""
    global _installed
    if _installed:
        return
    read, write = os.pipe()  # both ends non-inheritable: the run's own subprocesses never hold the pipe open
    echo = "echo" if faulthandler.is_enabled() else "quiet"
    subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHER, line, echo], stdin=read, close_fds=True)
    os.close(read)
    faulthandler.enable(file=write, all_threads=True)  # the write end stays open until the process ends
    _installed = True
