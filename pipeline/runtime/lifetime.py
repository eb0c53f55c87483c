"""How long a run's processes live, and what they leave behind.

* The driver (`StopSignals`): Ctrl-C, SIGTERM or its terminal's hangup
  (SIGHUP; not under nohup) asks the run to stop; the driver checkpoints,
  writes its results marked interrupted, closes what it started and exits
  128 + the signal's number. A second signal stops at once. Its output's
  reader going away (`| head` done, `less` quit: `stdout_failed`) asks the
  same, as SIGPIPE.
* Its children (`children_context` starts them, `child_started` is the first
  thing in every hub, trainer and rate measurement): a terminal's Ctrl-C or
  hangup reaches the whole process group, and so does a SIGTERM from
  `timeout`, Slurm or systemd; the children ignore them and let the driver
  stop them in order (it kills those it no longer needs); a watch on the
  parent makes them exit, removing what the run had in /dev/shm and its
  folders in the temporary folder (rendezvous folders, multiprocessing's),
  if it dies without a word (SIGKILL, the OOM killer).
* A node agent (`agent_stop_signals`): the same three signals end it in
  order, exit 0; its children are a run's children, as above.
* The next run (`remove_stale_files`): removes what a run killed outright left
  in /dev/shm and its folders in the temporary folder: those whose owner
  process is gone (their names, or a mark in them, carry its pid). A
  node agent started again also removes the semaphores no live process holds
  (`remove_stale_semaphores`): a host killed outright leaves its agent's.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import logging
import multiprocessing as mp
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from multiprocessing import connection, forkserver, util

from rich.console import Console

SHM_DIR = "/dev/shm"
# Every shared-memory entry of a run is named ensemble-[out-]<pid of its owner>-...: rings
# (pipeline/delivery/ring.py) belong to the process that made them, hand-off files
# (pipeline/data/handoff.py) to the process that takes them.
SHM_ENTRY = re.compile(r"^ensemble-(?:out-)?(\d+)-")
# Folders where process groups with every rank on this host meet (pipeline/delivery/collective.py), in the
# temporary folder, are named ensemble-rendezvous-<pid of the process that made them>-...
RENDEZVOUS_FOLDER = re.compile(r"^ensemble-rendezvous-(\d+)-")
# multiprocessing's folder of a process (pymp-..., where its fork server listens) says nothing of its owner:
# children_context leaves a mark there, a file named ensemble-owner-<pid of that process>.
MP_FOLDER_MARK = re.compile(r"^ensemble-owner-(\d+)$")
# What the fork server imports once, in order, so that the children forked from it need not (children_context).
CHILD_PRELOAD = ["pipeline.runtime.fork_server", "torch", "torch._dynamo", "pipeline.training.trainer",
                 "pipeline.delivery.hub", "pipeline.training.rates"]
# Ctrl-C; `timeout`, Slurm, systemd; the terminal gone (an ssh session dropped, its window closed).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# A stop signal again within this many seconds is the same request delivered twice, not a second one:
# GNU timeout signals its child and then its whole process group, the child included.
REPEAT_S = 1.0


class Interrupted(Exception):
    """The user asked the run to stop (Ctrl-C, SIGTERM, ...) before the training loop could take it in order."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """The driver's stop signals (STOP_SIGNALS), in the main thread, for the length of a `with` block.

    The first signal sets `requested`. Once training has begun (`defer()`: the training loop polls it
    and stops in order, and what comes after, closing and results, runs to its end) that is all;
    before (start-up, rate measurement) it raises `Interrupted` there and then, and whatever was
    started closes on the way out. A second signal (REPEAT_S or more after the first) kills the run's
    child processes, removes its shared memory and exits at once. A hangup first points the streams
    that were on the terminal at /dev/null (a line written there would fail). Like the signal handlers,
    the process's `with` block is the one a broken stdout asks to stop (`stdout_failed`).
    """

    active: StopSignals | None = None
    asked_between: int | None = None  # a stop asked while no block was active (before_it_begins)

    def __init__(self):
        self.requested = threading.Event()
        self.signum: int | None = None  # the first stop's, once asked (set before `requested`: see _handle)
        self._first_at = 0.0
        self._deferred = False
        self._previous: dict = {}
        self._outer: StopSignals | None = None
        self._on_terminal: tuple = ()  # of stdout and stderr, those on a terminal: asked at the start (after
        # a hangup, asking fails)

    def __enter__(self) -> StopSignals:
        for signum in STOP_SIGNALS:
            if signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN:
                continue  # nohup: asked to outlive its terminal
            self._previous[signum] = signal.signal(signum, self._handle)
        self._on_terminal = tuple(stream for stream in (sys.stdout, sys.stderr) if stream.isatty())
        self._outer, StopSignals.active = StopSignals.active, self
        return self

    def __exit__(self, *exc) -> None:
        StopSignals.active = self._outer
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def before_it_begins(self) -> None:
        """The block's first step: a stop asked while no block was active (stdout's reader went away between
        two jobs of a multirun run in this process, as the basic launcher runs them, found by Hydra's line
        that starts the next) stops it here, as `Interrupted`, and the multirun with it, instead of leaving
        the jobs left to run with their output going nowhere."""
        if StopSignals.asked_between is not None:
            self.request(StopSignals.asked_between)

    def defer(self) -> None:
        """From now to the `with` block's end, a first signal only sets `requested`, which the training loop
        polls; one after the loop lets the run end in order too (marked interrupted as its processes close,
        its results whole once they are being written: the command then exits, pipeline/__main__.py)."""
        self._deferred = True

    def request(self, signum: int) -> None:
        """The first stop, as the signal `signum` asks it. Raised as `Interrupted` only in the main thread (as
        a signal is): another thread's request is taken by the training loop once it begins (so in
        mode=profile, which has none, by the command's exit once the run is done)."""
        self.signum, self._first_at = signum, time.monotonic()
        self.requested.set()
        with contextlib.suppress(OSError):  # stderr gone too (2>&1 | head): the line has nowhere to go
            print(f"\n{signal.Signals(signum).name}: stopping in order: the last finished epochs are kept and "
                  "the run closes (a second Ctrl-C stops at once)", file=sys.stderr, flush=True)
        if not self._deferred and threading.current_thread() is threading.main_thread():
            raise Interrupted(signum)

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGHUP:
            _to_devnull(*self._on_terminal)
        if self.signum is not None:  # not `requested`: this may run inside its set(), whose lock it holds
            if signum == signal.SIGHUP or time.monotonic() - self._first_at < REPEAT_S:
                return  # the same request again (the kernel and the shell both send a hangup), or twice
            _stop_now(signum)
        self.request(signum)


def agent_stop_signals() -> None:
    """A node agent's stop signals (STOP_SIGNALS): Ctrl-C, SIGTERM, or its terminal's hangup (an ssh session
    dropped) end it in order and without a traceback, exit 0: the SystemExit raised in the main thread runs
    its `finally`, which closes what it started. One ignored from the start stays ignored (nohup's hangup:
    it serves on). While it closes, SIGTERM and hangups are ignored (a hangup comes from the kernel and from
    the shell; `timeout` signals the whole group too): a close cut short would leave its Dask workers or
    shared memory behind. A second Ctrl-C cuts it short, as asked."""
    on_terminal = tuple(stream for stream in (sys.stdout, sys.stderr) if stream.isatty())  # unaskable after a hangup
    taken = [signum for signum in STOP_SIGNALS if signal.getsignal(signum) != signal.SIG_IGN]

    def stop(signum: int, frame) -> None:
        if signum == signal.SIGHUP:  # first: a signal's handler may run inside this one's
            _to_devnull(*on_terminal)
        for each in {signal.SIGTERM, signal.SIGHUP} & set(taken):
            signal.signal(each, signal.SIG_IGN)
        if signal.SIGINT in taken:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        raise SystemExit(0)

    for signum in taken:
        signal.signal(signum, stop)


def stdout_failed(error: BaseException) -> bool:
    """What a writer of the run's stdout does when a write there failed with `error`, instead of crashing the
    run there (rich's way for a broken pipe was exit(1): a run that had trained ended before its results
    were written) or printing a logging error each line. Writers call it: RunConsole, StdoutLogHandler.

    * A broken pipe: its reader went away (`| head` has its lines, `less` quit). The run stops in order, as
      SIGPIPE would ask; between two jobs of a multirun (no run active), the next stops as it begins.
    * EIO on a terminal (a character device: fstat, unlike isatty, still answers after a hangup): it hung
      up, and nothing asked the run to stop (its hangup ignored, `trap '' HUP`, or never sent: `cmd &` then
      `exit` from a bash without huponexit; `disown`), so it was meant to outlive the terminal: it trains on,
      as under nohup.

    Either way what is still printed or logged there goes to /dev/null (stderr's too, if it is the same file:
    `2>&1 | head`, one terminal), print()'s lines and the flush at exit too, and this returns True. Any other
    error (EIO from a file on a failing disk) is the writer's to raise: False."""
    reader_gone = isinstance(error, BrokenPipeError)
    if not (reader_gone or isinstance(error, OSError) and error.errno == errno.EIO):
        return False
    out, err = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    if not (reader_gone or stat.S_ISCHR(out.st_mode)):
        return False
    _to_devnull(sys.stdout, *([sys.stderr] if (out.st_dev, out.st_ino) == (err.st_dev, err.st_ino) else []))
    if reader_gone:
        stop = StopSignals.active
        if stop is None:
            StopSignals.asked_between = signal.SIGPIPE
        elif stop.signum is None:
            stop.request(signal.SIGPIPE)
    return True


def _to_devnull(*streams) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in streams:
        os.dup2(devnull, stream.fileno())
    os.close(devnull)


class RunConsole(Console):
    """The run's terminal output (stdout), rich's console but for a write there that fails (`stdout_failed`)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        stdout_failed(BrokenPipeError())

    def _check_buffer(self) -> None:
        try:  # rich's own method (it writes the buffer): it takes a broken pipe to on_broken_pipe, and no other error
            super()._check_buffer()
        except OSError as error:
            if not stdout_failed(error):
                raise
            self.quiet = True


class StdoutLogHandler(logging.StreamHandler):
    """The console handler of Hydra's logging (hydra.job_logging, hydra.hydra_logging: pipeline/conf/config.yaml),
    but for a write there that fails (`stdout_failed`)."""

    def handleError(self, record: logging.LogRecord) -> None:
        if not stdout_failed(sys.exc_info()[1]):
            super().handleError(record)


def _stop_now(signum: int) -> None:
    """The second signal: no checkpoints, no report; nothing of the run is left running. Its processes
    are those this process started (hubs, trainers, rate measurements, a LocalCluster's Dask workers);
    multiprocessing's own helpers exit with it (the fork server, and the resource tracker, which then
    unlinks the semaphores the run registered)."""
    children = stop_children(wait_s=1.0)  # a start under way may wait on the fork server's imports
    for child in children:
        child.join(5)
    remove_files_of(os.getpid())
    os._exit(128 + signum)  # as a shell reports a process its signal ended


class ChildrenStopped(RuntimeError):
    """This process is stopping (stop_children): it starts no child."""


# a child's start and stop_children exclude each other; reentrant: the second signal's handler (_stop_now)
# may run in the main thread in the middle of a start there
_child_starts = threading.RLock()
_children_stopped = False


@contextlib.contextmanager
def child_start(name: str):
    """Around the start of a child process named `name`: refused (ChildrenStopped) once stop_children ran."""
    with _child_starts:
        refuse_once_stopped(name, "it starts no child")
        yield


def refuse_once_stopped(what: str, why: str) -> None:
    """Raises ChildrenStopped (`what`: this process is stopping; `why`) once stop_children ran: a child's start,
    or an answer about children read after their kill (their exit codes would pass the kill off as their failure)."""
    if _children_stopped:  # set before the kill: an exit code read after it finds it set
        raise ChildrenStopped(f"{what}: this process is stopping; {why}")


def stop_children(wait_s: float | None = None) -> list:
    """This process is stopping: every child it started is killed now (ours ignore SIGTERM, and
    multiprocessing's exit would wait for them), and none starts after, whichever thread asks (a call a
    node agent is still serving): child_start refuses. A start under way is waited for, `wait_s` at most
    (None: as long as it takes; past it, that child is left to its parent watch). Returns the children killed."""
    global _children_stopped
    waited = _child_starts.acquire(timeout=-1 if wait_s is None else wait_s)
    try:
        _children_stopped = True
        children = mp.active_children()
        for child in children:
            child.kill()
    finally:
        if waited:
            _child_starts.release()
    return children


def standard_start_method() -> None:
    """Makes the process's default start method one of the standard library's. A launcher's worker
    process may have made its own the default (joblib's loky: "loky"); a spawned child, such as a
    Dask worker, sets its parent's default first and cannot find that one ("cannot find context for
    'loky'"). The run's own children name their context; so do Dask's."""
    if mp.get_start_method(allow_none=True) not in (None, *mp.get_all_start_methods()):
        mp.set_start_method("spawn", force=True)


def children_context():
    """The multiprocessing context a run's hubs, trainers and rate measurements start from:
    multiprocessing's fork server, a process that imports torch and our children's modules once
    (CHILD_PRELOAD), runs nothing of them, and forks each child from that state. A spawned child would import torch
    anew, about 4 s of CPU (torch, then torch._dynamo, which the first optimiser imports); a forked one
    starts at once. Not plain fork: the driver has threads (Dask's, torch's). The server blocks the stop
    signals first (pipeline/runtime/fork_server.py), and the children it forks start with them blocked.
    One per process, like multiprocessing's resource tracker: it serves the runs a process makes, holds
    nothing of theirs, and exits when that process does. Started here, it imports while the caller
    goes on; the first child started waits for it."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(CHILD_PRELOAD)
    # Started with the stop signals blocked; so is multiprocessing's resource tracker if this starts it (it
    # ignores SIGINT and SIGTERM itself and keeps SIGHUP blocked: a hangup cannot end it either).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    # Its socket's folder, left if this process is killed outright, is then found by its owner's pid; marked by a
    # process that no multiprocessing process started: such a child takes its parent's folder (children copy
    # their parent's multiprocessing settings), which its mark would have had removed once the child was gone.
    if mp.parent_process() is None:
        open(os.path.join(util.get_temp_dir(), _mp_folder_mark(os.getpid())), "a").close()
    return context


def child_started(role: str) -> None:
    """First thing in a child process of a run (hub, trainer, rate measurement): the driver stops it,
    not a stop signal sent to the whole process group; and it does not outlive its parent. `role`
    names it in ps and top."""
    _name_process(role)
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked in the fork server: fork_server.py
    parent = mp.parent_process()  # the process that started this one, though a fork server forked it
    threading.Thread(target=_watch_parent, args=(parent.sentinel,), name="parent-watch", daemon=True).start()


def _name_process(name: str) -> None:
    import ctypes

    PR_SET_NAME = 15  # <linux/prctl.h>: the name ps, top and psutil show (15 bytes)
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the process keeps its name
        pass


def _watch_parent(sentinel: int) -> None:
    connection.wait([sentinel])  # readable once the parent is gone: it held the other end of the pipe
    parent_gone()


def parent_gone() -> None:
    """In a child whose parent died without a word: removes what the run had in /dev/shm and the
    temporary folder, and exits."""
    remove_files_of(mp.parent_process().pid)  # the parent's rings and folders: it cannot remove them any more
    remove_files_of(os.getpid())  # hand-off files this process would have taken
    os._exit(1)


# Signals that end a process because a native library (torch, oneDNN, a codec) crashed in it.
CRASH_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)


def how_it_ended(exit_code: int) -> str:
    """What a child's exit code says of how it ended, with the usual cause and the next step."""
    if exit_code >= 0:
        return f"exited with code {exit_code}"
    try:
        name = signal.Signals(-exit_code).name
    except ValueError:
        return f"was ended by signal {-exit_code}"
    if -exit_code == signal.SIGKILL:
        return ("was killed (SIGKILL): usually the kernel's out-of-memory killer (`dmesg` says), or someone's "
                "kill -9; give it more memory or train fewer or smaller models on a slot")
    if -exit_code in CRASH_SIGNALS:
        return (f"crashed ({name}): a native library (torch, oneDNN, a codec) failed inside it; run again with "
                "PYTHONFAULTHANDLER=1 to see the Python line it was on")
    return f"was ended by {name}"


def remove_shm(prefix: str) -> list[str]:
    """Remove the /dev/shm entries whose names start with `prefix`; the names removed."""
    return _unlink(glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "*")))


def _unlink(paths) -> list[str]:
    """Unlink `paths`; the names of those this call removed (another process may get there first)."""
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except FileNotFoundError:
            pass
    return removed


def remove_files_of(pid: int) -> list[str]:
    """Remove what process `pid` owns in /dev/shm (rings it made, hand-off files it takes) and in the
    temporary folder (its rendezvous folders, its multiprocessing folder); the names removed."""
    return remove_shm(f"ensemble-{pid}-") + remove_shm(f"ensemble-out-{pid}-") + _remove_folders_of(pid)


def rendezvous_folder() -> str:
    """A new folder (mode 0700) of this process's in the temporary folder, named by its pid: one a
    process killed outright leaves is removed by its children or the next run (remove_files_of)."""
    return tempfile.mkdtemp(prefix=_rendezvous_prefix(os.getpid()))


def _rendezvous_prefix(pid: int | str) -> str:
    return f"ensemble-rendezvous-{pid}-"


def _mp_folder_mark(pid: int | str) -> str:
    return f"ensemble-owner-{pid}"


def _folder_globs(owner: int | str) -> tuple[str, str]:
    """Glob patterns of the rendezvous folders of process `owner` (a pid, or "*": any) and of the marks in its
    multiprocessing folders, in the temporary folder."""
    temporary = glob.escape(tempfile.gettempdir())
    return (os.path.join(temporary, _rendezvous_prefix(owner) + "*"),
            os.path.join(temporary, "pymp-*", _mp_folder_mark(owner)))


def _remove_folders_of(pid: int) -> list[str]:
    """Remove process `pid`'s folders in the temporary folder: its rendezvous folders and the multiprocessing
    folder marked as its; the names of those this call removed."""
    rendezvous, marks = _folder_globs(pid)
    folders = glob.glob(rendezvous) + [os.path.dirname(mark) for mark in glob.glob(marks)]
    removed = []
    for path in folders:
        try:
            shutil.rmtree(path)
            removed.append(os.path.basename(path))
        except FileNotFoundError:  # another process got there first
            pass
    return removed


def remove_stale_files() -> list[str]:
    """Remove what runs killed outright left in /dev/shm and in the temporary folder (remove_files_of):
    this user's entries whose owner process is gone. A live run's (its owner is alive) are never touched.
    Returns the names removed."""
    owners = set()
    rendezvous, marks = _folder_globs("*")
    for pattern, name in ((os.path.join(SHM_DIR, "ensemble-*"), SHM_ENTRY), (rendezvous, RENDEZVOUS_FOLDER),
                          (marks, MP_FOLDER_MARK)):
        for path in glob.glob(pattern):
            match = name.match(os.path.basename(path))
            try:
                mine = os.stat(path, follow_symlinks=False).st_uid == os.getuid()
            except FileNotFoundError:
                continue
            if match and mine:
                owners.add(int(match.group(1)))
    return [name for pid in sorted(owners) if not _alive(pid) for name in remove_files_of(pid)]


def remove_stale_semaphores() -> list[str]:
    """Remove multiprocessing's named semaphores (sem.mp-*) of this user that no live process has open:
    left by processes killed outright together with their resource tracker (a lost host's agent). A
    process holding a semaphore maps its file (under the temporary name it was made with: it is known by
    its inode); a process whose maps this user cannot read (another user's) cannot open this user's
    semaphores (mode 0600). Returns the names removed."""
    ours = {}  # inode -> path
    for path in glob.glob(os.path.join(SHM_DIR, "sem.mp-*")):
        try:
            status = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if status.st_uid == os.getuid():
            ours[status.st_ino] = path
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as file:
                for line in file:
                    if f"{SHM_DIR}/sem." in line:
                        ours.pop(int(line.split()[4]), None)
        except OSError:  # gone meanwhile, or another user's
            continue
    return sorted(_unlink(ours.values()))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
