"""One clear line when a command's process is ended by a fatal signal (SIGABRT above all: XLA aborts a process whose
collective waited past its limit, 40 s on CPUs; a C++ exception that nothing catches, such as gloo's, aborts too),
after the native log: what the log says happened, and what to do next.

An aborting process runs no more Python: the signal ends it from the thread where XLA or gloo gave up. So the line
comes from a watcher, a small child process reading two pipes. Into one, ``faulthandler`` writes its report of a
fatal signal (``Fatal Python error: Aborted`` and the threads' Python stacks). The other is what native code writes
to the process's standard error (file descriptor 2: XLA's and gloo's messages, the last words of a C++ abort): the
watcher passes it on to the real standard error as it comes and keeps its tail, which names the cause (``CAUSES``).
Python's own ``sys.stderr`` keeps writing to the real standard error directly (a terminal stays a terminal for the
progress bar). The watcher prints the command's line after ``faulthandler``'s report itself where ``faulthandler`` was
already on (``python -X faulthandler``, pytest). At any other end (an exit, Ctrl-C, SIGKILL) the report pipe closes
with nothing in it and the watcher ends without a word.
"""
from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys

# What the native log's tail says, first match wins: (a regular expression, what it means). In the command's line
# after "ended by a fatal signal (Aborted)".
CAUSES = (
    (r"Received data size doesn't match expected size|op\.preamble\.length <= op\.nbytes",
     "gloo, which carries XLA:CPU's collectives between processes, received a message of another collective (\"Received "
     "data size doesn't match expected size\"): two collectives of one program ran at once"),
    (r"Termination timeout for .*RendezvousKey|collective.*(timed out|Timeout)",
     "XLA waited past its limit for a collective that not every device reached (\"Termination timeout for ... "
     "RendezvousKey\")"),
    (r"gloo::EnforceNotMet|Gloo .* failed",
     "gloo, which carries XLA:CPU's collectives between processes, failed (\"gloo::EnforceNotMet\"): the log above "
     "says where; the other processes' logs may say why"),
    (r"std::bad_alloc|RESOURCE_EXHAUSTED|[Oo]ut of memory",
     "the process ran out of memory (\"std::bad_alloc\" or \"RESOURCE_EXHAUSTED\")"),
    (r"Check failed", "an internal check of XLA failed (\"Check failed\"): the log above says which"),
)
UNKNOWN = "the log above says why"

# The watcher: ignores the terminal's Ctrl-C and a job's SIGTERM (the run handles those, and its end closes the
# pipes), passes the native output on, and once the process is gone names the signal and what the output said.
_WATCHER = r"""
import json, os, re, select, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
line, causes, unknown, echo, native = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
report, tail, open_fds, said = b"", b"", {0, native}, False


def say():
    found = re.search(r"Fatal Python error: ([^\n]+)", report.decode(errors="replace"))
    if found:
        text = tail.decode(errors="replace")
        cause = next((what for pattern, what in causes if re.search(pattern, text)), unknown)
        if echo == "echo":
            sys.stderr.write(report.decode(errors="replace"))
        sys.stderr.write(line.format(signal=found.group(1).strip(), cause=cause) + "\n")
        sys.stderr.flush()


while open_fds:
    ready, _, _ = select.select(list(open_fds), [], [], None if 0 in open_fds else 0.5)
    if not ready and not said:  # the process is gone and its native output has gone quiet
        said = True
        say()
    for fd in ready:
        data = os.read(fd, 1 << 16)
        if not data:
            open_fds.discard(fd)
        elif fd == native:
            os.write(2, data)
            tail = (tail + data)[-(1 << 16):]
        else:
            report += data
if not said:
    say()
"""

_installed = False


def explain_fatal_signals(line: str) -> None:
    """From now on, a fatal signal ending this process is followed on stderr by ``line``, where ``{signal}`` becomes
    the signal's name (e.g. "Aborted") and ``{cause}`` what the native log said (``CAUSES``, else ``UNKNOWN``).
    Once per process; later calls do nothing."""
    global _installed
    if _installed:
        return
    report_read, report_write = os.pipe()  # non-inheritable: the run's own subprocesses never hold it open
    native_read, native_write = os.pipe()
    echo = "echo" if faulthandler.is_enabled() else "quiet"
    subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHER, line, json.dumps(CAUSES), UNKNOWN, echo,
                      str(native_read)], stdin=report_read, pass_fds=(native_read,), close_fds=True)
    os.close(report_read)
    os.close(native_read)
    # Python's stderr stays the real one (a dup of it); descriptor 2, what native code and subprocesses write to,
    # becomes the watcher's pipe
    sys.stderr.flush()
    real = os.dup(2)
    os.dup2(native_write, 2)
    os.close(native_write)
    sys.stderr = open(real, "w", buffering=1, encoding=sys.stderr.encoding, errors=sys.stderr.errors)
    faulthandler.enable(file=report_write, all_threads=True)  # the write end stays open until the process ends
    _installed = True
