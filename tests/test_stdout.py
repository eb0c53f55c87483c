"""A run's stdout whose reader went away (`| head`), found by a log line or a print, in a small process of
its own (the real command's case: tests/test_lifetime.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Logs a line (Hydra's console handler, as configured: the first to find the pipe broken), then prints
# (rich and print()) and logs again, all with nowhere to go, and says how to resume on stderr: none may raise.
# Exits 0 if the stop was asked as SIGPIPE, once.
WRITER = """
import logging, signal, sys
from pipeline.runtime.lifetime import RunConsole, StdoutLogHandler, StopSignals

log = logging.getLogger("run")
log.addHandler(StdoutLogHandler(sys.stdout))
log.propagate = False
with StopSignals() as stop:
    stop.defer()  # training has begun: the request is taken by the loop, not raised
    log.warning("a line no one reads")
    asked = stop.signum
    stop.signum = None  # so that a second request would show
    RunConsole().print("the run's table")
    print("its last line", flush=True)
    log.warning("another")
    print("how to resume", file=sys.stderr, flush=True)
sys.exit(0 if asked == signal.SIGPIPE and stop.signum is None else 1)
"""


@pytest.mark.parametrize("stderr_too", [False, True], ids=["stdout piped", "2>&1 piped"])
def test_a_log_line_that_finds_stdout_broken_asks_the_stop_and_nothing_raises(stderr_too, tmp_path):
    """The log handler, not a print, finds the pipe broken: the run is asked to stop as SIGPIPE would ask,
    once; what follows goes nowhere without an error. With stderr on the same pipe (2>&1 | head) the stop's
    line has nowhere to go either; with stderr apart, it says so there, and no logging error."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    with open(tmp_path / "stderr", "w+") as stderr:
        done = subprocess.run([sys.executable, "-c", WRITER], cwd=REPO, stdout=write,
                              stderr=write if stderr_too else stderr, timeout=60)
        os.close(write)
        stderr.seek(0)
        said = stderr.read()
    assert done.returncode == 0, said
    assert said == ("" if stderr_too else "\nSIGPIPE: stopping in order: the last finished epochs are kept and "
                                          "the run closes (a second Ctrl-C stops at once)\nhow to resume\n")


# Between two jobs of a multirun: Hydra's line that starts the next job is the first to find the pipe broken,
# while no run is active. Exits 0 if the next block stopped as it began, as SIGPIPE, before its first step.
BETWEEN_JOBS = """
import logging, signal, sys
from pipeline.runtime.lifetime import Interrupted, StdoutLogHandler, StopSignals

log = logging.getLogger("hydra")
log.addHandler(StdoutLogHandler(sys.stdout))
log.propagate = False
log.warning("#1 : ensemble.models.0.optimizer.lr=0.05")
with StopSignals() as stop:
    try:
        stop.before_it_begins()
        stopped_by = None
    except Interrupted as stopped:
        stopped_by = stopped.signum
sys.exit(0 if stopped_by == signal.SIGPIPE else 1)
"""


def test_a_stdout_broken_between_two_jobs_stops_the_next_as_it_begins(tmp_path):
    """A multirun's next job does not run with its output going nowhere (and the jobs after it: for hours):
    it stops before it begins, as the job during which the pipe broke would have (pipeline/__main__.py
    exits 141 then, and so ends the multirun)."""
    read, write = os.pipe()
    os.close(read)
    done = subprocess.run([sys.executable, "-c", BETWEEN_JOBS], cwd=REPO, stdout=write, stderr=subprocess.PIPE,
                          text=True, timeout=60)
    os.close(write)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Logging error" not in done.stderr, done.stderr


# On a terminal that hung up while nothing asked the run to stop (its hangup ignored or never sent): a first line
# by the writer its second argument names (the console, rich; or the log handler), then the console's lines, a log
# line, print()s to stdout and stderr. Exits 0 if none raised and no stop was asked; what raised is written to the
# file its first argument names (stderr is on the dead terminal too).
ON_A_DEAD_TERMINAL = """
import logging, sys, traceback
from pipeline.runtime.lifetime import RunConsole, StdoutLogHandler, StopSignals

log = logging.getLogger("run")
log.addHandler(StdoutLogHandler(sys.stdout))
log.propagate = False
console = RunConsole()
sys.stdin.read(1)  # the terminal is gone now
try:
    with StopSignals() as stop:
        stop.defer()
        {"console": console.print, "log": log.warning}[sys.argv[2]]("epoch 2: val accuracy 0.5")
        log.warning("a line no one reads")
        console.print("the run's table")
        print("its last line", flush=True)
        print("and on stderr", file=sys.stderr, flush=True)
except BaseException:
    open(sys.argv[1], "w").write(traceback.format_exc())
    raise
sys.exit(0 if stop.signum is None else 3)
"""


@pytest.mark.parametrize("first", ["console", "log"])
def test_a_terminal_gone_without_a_stop_sends_the_lines_nowhere_and_the_run_goes_on(first, tmp_path):
    """stdout and stderr on a terminal that hung up (its master closed; not the process's controlling
    terminal, so no SIGHUP): the first line written there fails (EIO), whichever writer finds it (the
    console, or the log handler first), and what follows goes nowhere; no error, no stop."""
    master, terminal = os.openpty()
    go, ready = os.pipe()
    raised = tmp_path / "raised"
    writer = subprocess.Popen([sys.executable, "-c", ON_A_DEAD_TERMINAL, str(raised), first], cwd=REPO, stdin=go,
                              stdout=terminal, stderr=terminal, env={**os.environ, "TERM": "xterm"})
    os.close(terminal)
    os.close(go)
    os.close(master)  # the terminal hangs up
    os.write(ready, b"!")
    os.close(ready)
    assert writer.wait(60) == 0, raised.read_text() if raised.exists() else f"exit code {writer.returncode}"
