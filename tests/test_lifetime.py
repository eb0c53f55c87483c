"""A run's lifetime through the real command, with real signals: Ctrl-C stops it in order and it
resumes to the same result as a run never stopped; SIGKILL leaves no process and no shared memory
behind; a model given up makes the run exit non-zero. One interrupted run serves several checks."""
import glob
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from pipeline.runtime.lifetime import REPEAT_S, StopSignals, remove_stale_files, remove_stale_semaphores
from pipeline.run import run
from tests.conftest import compose_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def overrides(data: Path, *extra) -> list[str]:
    return ["+ensemble=caltech256", f"dataset.root={data}", "dataset.synthetic_classes=3",
            "dataset.synthetic_images_per_class=16", "pipeline.batch_size=16", "pipeline.image_size=32",
            "pipeline.alt_image_size=24", "cluster.workers=2", "scheduler.patience=0", *extra]  # epochs fixed


def command(data: Path, folder: Path, *extra) -> list[str]:
    return [sys.executable, "-m", "pipeline", *overrides(data, *extra), f"hydra.run.dir={folder}"]


class Job:
    """The command in its own session (as a terminal runs it); a thread reads its output as it comes."""

    started: "list[Job]" = []  # killed, with their sessions, when their test ends (no_job_outlives_its_test)

    def __init__(self, args: list[str]):
        self.process = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
        Job.started.append(self)
        self.lines: list[str] = []
        self.new_line = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self.new_line:
                self.lines.append(line)
                self.new_line.notify_all()
        with self.new_line:
            self.lines.append(None)  # the end
            self.new_line.notify_all()

    def wait_for(self, text: str, timeout: float = 300) -> None:
        """Until a line of its output holds `text`."""
        seen = lambda: any(line is None or text in line for line in self.lines)
        with self.new_line:
            if not self.new_line.wait_for(seen, timeout) or self.lines[-1] is None and \
                    not any(line and text in line for line in self.lines):
                raise AssertionError(f"no {text!r} in its output:\n" + self.output()[-3000:])

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)

    def output(self) -> str:
        return "".join(line for line in self.lines if line)

    def finish(self, timeout: float = 300) -> str:
        self.process.wait(timeout)
        self.reader.join(timeout)
        return self.output()


@pytest.fixture(autouse=True)
def no_job_outlives_its_test():
    """A test that fails while its command runs must not leave the run behind (its processes, a
    stopped trainer): the command's whole session is killed."""
    yield
    while Job.started:
        job = Job.started.pop()
        if job.process.poll() is None:
            os.killpg(job.process.pid, signal.SIGKILL)
            job.process.wait()


def leftovers(pids) -> list[str]:
    """This run's entries in /dev/shm, its rendezvous folders (they carry their owner's pid) and its
    multiprocessing folders (marked with their owner's pid)."""
    temporary = glob.escape(tempfile.gettempdir())
    return ([name for name in os.listdir("/dev/shm") for pid in pids
             if name.startswith((f"ensemble-{pid}-", f"ensemble-out-{pid}-"))] +
            [name for name in os.listdir(tempfile.gettempdir()) for pid in pids
             if name.startswith(f"ensemble-rendezvous-{pid}-")] +
            [Path(mark).parent.name for pid in pids
             for mark in glob.glob(os.path.join(temporary, "pymp-*", f"ensemble-owner-{pid}"))])


def gone_within(processes: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    """Those still alive after `seconds` (an exited one whose parent died waits to be reaped: a zombie)."""
    _, alive = psutil.wait_procs(processes, timeout=seconds)
    return [p for p in alive if _status(p) not in (psutil.STATUS_ZOMBIE, None)]


def _status(process: psutil.Process) -> str | None:
    try:
        return process.status()
    except psutil.NoSuchProcess:
        return None


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data") / "synthetic"


def test_ctrl_c_stops_in_order_and_resume_ends_as_a_run_never_stopped(data, tmp_path):
    """scheduler=shared, a checkpoint every 2 epochs: Ctrl-C (SIGINT to the process group) after epoch 3.
    The run checkpoints epoch 3 anyway, writes results marked interrupted, leaves no process and no
    shared memory, exits 130 within timeouts.stop_s and the run's close with one resume line and no
    traceback. Resumed, it trains the epochs left on the very batches a run never stopped trains them on,
    and its results match."""
    settings = ["trainer.epochs=5", "scheduler.checkpoint_every=2", "trainer.record_checksums=true"]
    stopped = tmp_path / "stopped"
    job = Job(command(data, stopped, *settings))
    job.wait_for("(epoch 3)")
    children = job.children()
    signalled = time.monotonic()
    os.killpg(job.process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    output = job.finish(timeout=60)
    took = time.monotonic() - signalled
    assert job.process.returncode == 130, output[-3000:]
    # timeouts.stop_s's default, then results, report, Dask's close: under timeouts.exit_s's 30 s, which a
    # stop that waited for a process to exit would reach
    assert took < 10 + 15, took
    assert not gone_within(children, 1), "processes of the run outlived it"
    assert not leftovers([job.process.pid] + [c.pid for c in children])
    assert "Traceback" not in output, output[-3000:]
    resume_lines = [line for line in output.splitlines() if "to resume:" in line]
    assert len(resume_lines) == 1 and resume_lines[0].endswith(f"resume={stopped}"), output[-2000:]
    results = json.loads((stopped / "results.json").read_text())
    assert results["interrupted"]["cause"] == "SIGINT"
    assert "Interrupted (SIGINT)" in (stopped / "report.html").read_text()
    done = {m["name"]: m["epochs"] for m in results["models"]}
    assert min(done.values()) >= 3
    for model, epochs in done.items():  # the last finished epoch is checkpointed, though 3 is not a multiple of 2
        assert (stopped / "checkpoints" / model / f"epoch{epochs}.pt").is_file(), model

    resume = command(data, tmp_path / "hydra-of-the-resume", *settings, f"resume={stopped}")
    resumed = subprocess.run(resume, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    whole = json.loads((stopped / "results.json").read_text())
    assert "interrupted" not in whole and "Interrupted" not in (stopped / "report.html").read_text()
    # its rates count every image over the whole run's training time: the resumed part's alone made them
    # many times too high (worker busy 600% after 9 of 10 epochs)
    training_s = lambda r: r["pipeline"]["train_images"] / r["pipeline"]["images_per_s"]
    assert training_s(whole) > training_s(results) and whole["pipeline"]["train_images"] > \
        results["pipeline"]["train_images"]
    never_stopped = run(compose_config(overrides(data, *settings)), tmp_path / "never")
    for results in (whole, never_stopped):
        assert [(m["name"], m["epochs"], len(m["val_accuracy"])) for m in results["models"]] == \
               [(m["name"], 5, 5) for m in never_stopped["models"]]
        assert len(results["ensemble"]["val_accuracy"]) == 5  # each epoch counted once
        assert results["ensemble"]["final_val_accuracy"] is not None
    # The flotilla formed again goes on with its own sequence of epochs: the same shuffles, the same bytes.
    for trainer, after in whole["delivery"]["received"].items():
        after, every = [tuple(m) for m in after], [tuple(m) for m in never_stopped["delivery"]["received"][trainer]]
        assert 0 < len(after) < len(every) and after == every[-len(after):], trainer


def test_a_run_killed_outright_leaves_no_process_and_no_shared_memory(data, tmp_path):
    """SIGKILL to the driver (the OOM killer): its hubs, trainers and Dask workers exit within 10 s and
    remove what the run had in /dev/shm and its rendezvous folder."""
    job = Job(command(data, tmp_path / "killed", "trainer.epochs=20"))
    job.wait_for("(epoch 1)")
    children = job.children()
    names = {child.name() for child in children}
    assert {"hub", "trainer"} <= names, names
    pids = [job.process.pid] + [child.pid for child in children]
    running = leftovers(pids)
    assert any(name.startswith(f"ensemble-rendezvous-{job.process.pid}-") for name in running), running
    assert any(name.startswith("pymp-") for name in running), running  # where its fork server listens
    assert any(name.startswith("ensemble-") and "rendezvous" not in name for name in running), running  # rings
    job.process.kill()
    job.finish(timeout=30)
    alive = gone_within(children, 10)
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert not leftovers(pids)


def test_a_run_whose_output_s_reader_goes_away_stops_in_order(data, tmp_path):
    """`python -m pipeline ... | head`: once head has its lines and closes the pipe, the run's next line (printed
    or logged) finds it broken. The run stops in order, as for a stop signal (SIGPIPE): its finished epochs
    checkpointed, results marked interrupted, the resume line and no traceback or logging error on stderr,
    exit code 141 (128 + SIGPIPE, as a shell reports it), nothing left running. (rich's own way exited 1
    silently wherever it printed, a trained run's results unwritten.)"""
    folder = tmp_path / "piped"
    with open(tmp_path / "stderr", "w+") as stderr:
        run = subprocess.Popen(command(data, folder, "trainer.epochs=20"), cwd=REPO, stdout=subprocess.PIPE,
                               stderr=stderr, text=True, start_new_session=True)
        try:
            for line in run.stdout:  # head's lines: up to the first epoch's
                if "(epoch 1)" in line:
                    break
            children = psutil.Process(run.pid).children(recursive=True)
            run.stdout.close()
            assert run.wait(120) == 128 + signal.SIGPIPE
        finally:
            run.kill()
        stderr.seek(0)
        said = stderr.read()
    assert "Traceback" not in said and "Logging error" not in said, said[-3000:]
    assert said.splitlines()[-1].startswith("stopped (SIGPIPE); to resume: ") and f"resume={folder}" in said, said
    results = json.loads((folder / "results.json").read_text())
    assert results["interrupted"]["cause"] == "SIGPIPE"
    for model in results["models"]:
        assert 1 <= model["epochs"] < 20 and (folder / "checkpoints" / model["name"] /
                                              f"epoch{model['epochs']}.pt").is_file(), model
    assert not gone_within(children, 10) and not leftovers([run.pid] + [c.pid for c in children])


def test_a_run_whose_terminal_hangs_up_stops_in_order_unless_its_hangup_is_ignored(data, tmp_path):
    """Each run in a session of its own on a terminal of its own (`setsid -c` on a pty, as an ssh login gives),
    hung up: its master closed (the kernel sends the driver SIGHUP, and a line written there fails), then
    SIGHUP to its whole process group (as the shell sends its jobs). The run stops in order, as for a stop
    signal: no model failed (its trainers, hubs and workers ignore the hangup), results marked interrupted
    (SIGHUP), its finished epochs checkpointed, exit code 129, nothing left running or in /dev/shm. (Before,
    the hangup killed every process of the run at once, leaving its cache and rings in /dev/shm.) The same
    command with SIGHUP ignored (`trap '' HUP`, as nohup does, but its output left on the terminal, as a
    background job's is when its shell exits) trains to its end, its lines going nowhere once the terminal is
    gone (a write there fails, EIO: the first one crashed the run)."""
    def on_a_terminal(folder: Path, wrapper: list[str], *settings: str):
        master, terminal = os.openpty()
        run = subprocess.Popen(["setsid", "--ctty", *wrapper, *command(data, folder, *settings)], cwd=REPO,
                               stdin=terminal, stdout=terminal, stderr=terminal)
        os.close(terminal)
        return run, master

    # Both at once on 2 cores: the stop's checkpoints get longer than timeouts.stop_s's default share (5 s)
    hung, master = on_a_terminal(tmp_path / "hung", [], "trainer.epochs=20", "timeouts.stop_s=60")
    ignoring = ["sh", "-c", """trap '' HUP; exec "$@" """, "sh"]
    # 8 epochs: it must still be running when the hangup comes, after both runs' first epoch
    kept, kept_master = on_a_terminal(tmp_path / "kept", ignoring, "trainer.epochs=8")
    try:
        seen = {master: b"", kept_master: b""}  # each terminal's, read as it comes (a full one holds its run)
        while not all(b"val accuracy" in text for text in seen.values()):  # each run's first epoch's line
            ready = select.select(list(seen), [], [], 120)[0]
            assert ready, {terminal: text.decode(errors="replace")[-2000:] for terminal, text in seen.items()}
            for terminal in ready:
                try:
                    chunk = os.read(terminal, 4096)
                except OSError:  # EIO: the run, the terminal's last process, has ended
                    chunk = b""
                assert chunk or b"val accuracy" in seen[terminal], seen[terminal].decode(errors="replace")[-2000:]
                if not chunk:  # it ended after its line (a failure, said below): read the other one
                    del seen[terminal]
                    break
                seen[terminal] += chunk
        children = psutil.Process(hung.pid).children(recursive=True)
        assert {"hub", "trainer"} <= {child.name() for child in children}
        assert kept.poll() is None  # it has lines to write after the hangup: its epochs', its results'
        for job, terminal in ((hung, master), (kept, kept_master)):
            os.close(terminal)
            os.killpg(job.pid, signal.SIGHUP)  # setsid made it its session's (and group's) leader
        assert hung.wait(120) == 128 + signal.SIGHUP
        assert kept.wait(240) == 0
    finally:
        hung.kill()
        kept.kill()
    results = json.loads((tmp_path / "hung" / "results.json").read_text())
    assert results["interrupted"]["cause"] == "SIGHUP"
    for model in results["models"]:
        assert not model["failures"] and 1 <= model["epochs"] < 20, model
        saved = sorted(p.name for p in (tmp_path / "hung" / "checkpoints" / model["name"]).iterdir())
        assert f"epoch{model['epochs']}.pt" in saved, (model["name"], model["epochs"], saved)
    assert not gone_within(children, 10) and not leftovers([hung.pid] + [c.pid for c in children])
    results = json.loads((tmp_path / "kept" / "results.json").read_text())
    assert "interrupted" not in results and {m["epochs"] for m in results["models"]} == {8}


def test_a_second_ctrl_c_stops_at_once(data, tmp_path):
    """The first Ctrl-C starts the orderly stop, which a stopped (SIGSTOP) trainer holds up for most of
    timeouts.stop_s; a second one kills the run's processes and exits 130 at once."""
    job = Job(command(data, tmp_path / "impatient", "trainer.epochs=20", "timeouts.stop_s=30"))
    job.wait_for("(epoch 1)")
    children = job.children()
    next(c for c in children if c.name() == "trainer").suspend()  # it cannot write its checkpoint
    os.killpg(job.process.pid, signal.SIGINT)
    job.wait_for("stopping in order")  # printed once the driver has taken the first signal
    time.sleep(REPEAT_S)  # sooner, the next is the same request delivered twice
    signalled = time.monotonic()
    os.killpg(job.process.pid, signal.SIGINT)
    job.finish(timeout=60)
    assert job.process.returncode == 130
    assert time.monotonic() - signalled < 10  # the orderly stop would wait 15 s for the trainer
    assert not gone_within(children, 10)


def test_a_hung_trainer_does_not_hold_the_orderly_stop_past_its_time(data, tmp_path):
    """A trainer stopped (SIGSTOP) mid-run cannot write the checkpoint the scheduler asked for, nor the
    one the stop asks for: one Ctrl-C still ends the run within timeouts.stop_s and a few seconds, with
    its resume line, the trainer killed and nothing left."""
    job = Job(command(data, tmp_path / "hung", "trainer.epochs=20", "timeouts.stop_s=8"))
    job.wait_for("(epoch 1)")
    children = job.children()
    next(c for c in children if c.name() == "trainer").suspend()
    os.killpg(job.process.pid, signal.SIGINT)
    signalled = time.monotonic()
    output = job.finish(timeout=120)
    assert job.process.returncode == 130, output[-3000:]
    assert time.monotonic() - signalled < 8 + 20, output[-3000:]  # stop_s, then results, report, Dask's close
    assert sum("to resume:" in line for line in output.splitlines()) == 1, output[-2000:]
    assert not gone_within(children, 1), "processes of the run outlived it"
    assert not leftovers([job.process.pid] + [c.pid for c in children])


def test_sigterm_to_the_whole_process_group_stops_in_order(data, tmp_path):
    """As GNU timeout stops a command (SIGTERM to it, then to its whole process group; Slurm and systemd
    signal every process too): the children leave the stop to the driver, which counts the signal
    delivered twice as one request, checkpoints, exits 143 with its resume line; no Dask worker dies,
    nothing of the run is left."""
    job = Job(command(data, tmp_path / "timed_out", "trainer.epochs=20"))
    job.wait_for("(epoch 1)")
    children = job.children()
    os.kill(job.process.pid, signal.SIGTERM)
    os.killpg(job.process.pid, signal.SIGTERM)
    output = job.finish(timeout=60)
    assert job.process.returncode == 143, output[-3000:]
    assert "Traceback" not in output and "workers died" not in output, output[-3000:]
    assert sum("to resume:" in line for line in output.splitlines()) == 1, output[-2000:]
    results = json.loads((tmp_path / "timed_out" / "results.json").read_text())
    for model in results["models"]:
        assert (tmp_path / "timed_out" / "checkpoints" / model["name"] / f"epoch{model['epochs']}.pt").is_file()
    assert not gone_within(children, 1), "processes of the run outlived it"
    assert not leftovers([job.process.pid] + [c.pid for c in children])


def test_a_stopped_shared_sweep_goes_on_when_its_jobs_are_launched_again_into_its_folder(data, tmp_path):
    """hydra/launcher=shared, 2 jobs as one run, Ctrl-C after epoch 1: the multirun exits 130, no traceback,
    nothing of the run left, and says how to go on. The same command again resumes the shared run from its
    last finished epochs (it trains no first epoch again) and completes both jobs, each with all its epochs;
    once more, it writes their folders from the finished run and trains nothing."""
    sweep = tmp_path / "sweep"
    multirun = [sys.executable, "-m", "pipeline", "-m", *overrides(data, "trainer.epochs=4"), "hydra/launcher=shared",
                "ensemble.models.0.optimizer.lr=0.1,0.05", f"hydra.sweep.dir={sweep}"]
    job = Job(multirun)
    job.wait_for("(epoch 1)")
    children = job.children()
    os.killpg(job.process.pid, signal.SIGINT)
    output = job.finish(timeout=60)
    assert job.process.returncode == 130, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert f"launch the same jobs again with hydra.sweep.dir={sweep}" in output, output[-2000:]
    assert not gone_within(children, 1), "processes of the run outlived it"
    assert not leftovers([job.process.pid] + [c.pid for c in children])

    again = subprocess.run(multirun, cwd=REPO, capture_output=True, text=True, timeout=600)
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-3000:]
    assert "jobs 0, 1 go on with their shared run" in output and "(epoch 1)" not in output, output[-3000:]
    assert "j0.densenet40_k8 leaves (reached trainer.epochs=4)" in output, output[-3000:]  # why, in its words
    done = {}
    for number in (0, 1):
        results = done[number] = json.loads((sweep / str(number) / "results.json").read_text())
        assert [(m["epochs"], len(m["val_accuracy"])) for m in results["models"]] == [(4, 4)] * 4
        assert len(results["ensemble"]["val_accuracy"]) == 4  # the job's ensemble, epochs before the stop too
        assert results["objective"]["value"] == results["ensemble"]["kept"]["val_accuracy"]

    # Once more: the shared run finished, so the jobs' folders are written from it again, nothing trained.
    third = subprocess.run(multirun, cwd=REPO, capture_output=True, text=True, timeout=600)
    output = third.stdout + third.stderr
    assert third.returncode == 0, output[-3000:]
    assert "jobs 0, 1: their shared run finished" in output and "(epoch" not in output, output[-3000:]
    for number in (0, 1):
        again = json.loads((sweep / str(number) / "results.json").read_text())
        assert again["objective"] == done[number]["objective"] and again["models"] == done[number]["models"]


def test_a_stop_before_training_is_immediate_and_one_after_it_began_is_taken_in_order_to_the_end():
    """Before training (start-up, rate measurement) a first Ctrl-C raises Interrupted there and then: nothing is
    left to resume. From training's start to the run's end, the loop and then the closing included, it only
    asks to stop: a signal as a finished run closes once raised Interrupted there, which said "stopped before
    training began; nothing to resume" of a run that had trained and could resume."""
    from pipeline.runtime.lifetime import Interrupted

    before = signal.getsignal(signal.SIGINT)
    with StopSignals() as stop, pytest.raises(Interrupted, match="SIGINT"):
        signal.raise_signal(signal.SIGINT)
    with StopSignals() as stop:
        stop.defer()
        signal.raise_signal(signal.SIGINT)
        assert stop.requested.is_set() and stop.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before


def test_a_stop_as_a_finished_shared_run_closes_ends_the_multirun(monkeypatch, tmp_path, capsys):
    """A Ctrl-C that comes after the training loop, as the shared run closes: the run ends whole (results
    written, not interrupted) and the multirun stops with 130, saying how its jobs' folders get written; it
    no longer goes on to the next batch as if nothing had been asked."""
    from types import SimpleNamespace

    import pipeline.run
    from hydra_plugins.pipeline_launcher.shared_launcher import _train

    def finished_then_asked_to_stop(cfg, folder, stop, parts):
        stop.defer()  # training began
        signal.raise_signal(signal.SIGINT)  # the loop has ended; the run closes
        return {"models": []}

    monkeypatch.setattr(pipeline.run, "run", finished_then_asked_to_stop)
    with pytest.raises(SystemExit) as stopped:
        _train(SimpleNamespace(cfg=None, parts={}), tmp_path / "shared-0-1")
    assert stopped.value.code == 130
    assert (f"SIGINT: stopped as the shared run in {tmp_path / 'shared-0-1'} closed; it had finished: launch the "
            f"same jobs again with hydra.sweep.dir={tmp_path}") in capsys.readouterr().err


def test_stale_shared_memory_and_temporary_folders_are_removed_only_when_their_owner_is_gone(alone):
    """What a run killed before its children could clean up is removed by the next run: entries in
    /dev/shm, rendezvous folders and marked multiprocessing folders of dead owners only, never a live
    run's."""
    with alone():  # a run starting beside it would remove the dead owner's entries first
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        dead_pid = int(dead.stdout)
        names = [f"ensemble-{dead_pid}-abcd1234-h0-main", f"ensemble-out-{dead_pid}-x-train-0-1-0-main",
                 f"ensemble-{os.getpid()}-abcd1234-h0-main"]
        for name in names:
            Path("/dev/shm", name).write_bytes(b"x")
        folders = [Path(tempfile.mkdtemp(prefix=f"ensemble-rendezvous-{pid}-")) for pid in (dead_pid, os.getpid())]
        (folders[0] / "a-group").write_bytes(b"x")  # a group's file that its ranks, killed, did not remove
        mp_folders = [Path(tempfile.mkdtemp(prefix="pymp-")) for _ in range(3)]
        for folder, owner in zip(mp_folders, (dead_pid, os.getpid())):  # the third, unmarked: not ours
            (folder / f"ensemble-owner-{owner}").touch()
            (folder / "listener-abcd1234").touch()  # its fork server's socket
        try:
            removed = remove_stale_files()
            assert set(names[:2] + [folders[0].name, mp_folders[0].name]) <= set(removed)
            assert not {names[2], folders[1].name, mp_folders[1].name, mp_folders[2].name} & set(removed)
            assert [name for name in names if Path("/dev/shm", name).exists()] == names[2:]
            assert [folder.exists() for folder in folders + mp_folders] == [False, True, False, True, True]
        finally:
            for name in names:
                Path("/dev/shm", name).unlink(missing_ok=True)
            for folder in folders + mp_folders:
                shutil.rmtree(folder, ignore_errors=True)


def _start_a_fork_server(to_test) -> None:
    """In a spawned child: what a run does before its first child (children_context); sends its folder."""
    from multiprocessing import util

    from pipeline.runtime.lifetime import children_context

    children_context()
    to_test.send(util.get_temp_dir())


def test_a_child_that_starts_children_leaves_its_parents_folder_to_its_parent():
    """A multiprocessing child (a run inside a launcher's worker, a test's spawned helper) works in its parent's
    multiprocessing folder: its fork server listens there. It must not mark that folder as its own: once the
    child is gone, the next run's clean-up would remove the folder of a parent still alive (its fork server's
    socket, its Manager's), and the parent's next child would fail to start (seen with the suite in two
    processes)."""
    import multiprocessing as mp
    from multiprocessing import util

    folder = util.get_temp_dir()  # this process's, which the child takes as its own
    spawn = mp.get_context("spawn")
    received, to_test = spawn.Pipe(duplex=False)
    child = spawn.Process(target=_start_a_fork_server, args=(to_test,))
    child.start()
    to_test.close()
    try:
        assert received.poll(120), "the child said nothing"
        assert received.recv() == folder
    finally:
        child.join(30)
        child.kill()
    assert child.exitcode == 0
    assert not list(Path(folder).glob(f"ensemble-owner-{child.pid}"))
    remove_stale_files()
    assert Path(folder).is_dir()


def _resource_tracker_of(pid: int) -> int:
    """The pid of process `pid`'s resource tracker (multiprocessing starts it with the first semaphore),
    waited for: once, with the suite in two processes, none of the maker's children was it yet (what they
    were is in the message, should it happen again)."""
    deadline = time.monotonic() + 30
    while True:
        seen = []
        for child in psutil.Process(pid).children():
            try:
                seen.append((child.pid, child.status(), " ".join(child.cmdline())))
            except psutil.Error as err:
                seen.append((child.pid, type(err).__name__, ""))
        trackers = [child for child, _, command in seen if "resource_tracker" in command]
        if trackers:
            return trackers[0]
        assert time.monotonic() < deadline, f"no resource tracker among process {pid}'s children: {seen}"
        time.sleep(0.1)


def test_semaphores_no_live_process_holds_are_removed_and_held_ones_kept():
    """A process killed outright together with its resource tracker (a host's agent and everything under it)
    leaves its named semaphores in /dev/shm: an agent started again there removes them, never one that a
    live process holds."""
    import multiprocessing as mp

    make = ("import multiprocessing as mp, sys; lock = mp.get_context('forkserver').Lock(); "
            "print(lock._semlock.name, flush=True); sys.stdin.read()")
    maker = subprocess.Popen([sys.executable, "-c", make], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    name = maker.stdout.readline().strip()
    tracker = _resource_tracker_of(maker.pid)
    stale = Path("/dev/shm", "sem." + name.lstrip("/"))
    held = mp.get_context("forkserver").Lock()  # this process holds it
    live = Path("/dev/shm", "sem." + held._semlock.name.lstrip("/"))
    try:
        assert stale.exists() and live.exists()
        assert stale.name not in remove_stale_semaphores() and stale.exists()  # its maker holds it
        os.kill(tracker, signal.SIGKILL)  # first: else it unlinks what its dead client leaked
        maker.kill()
        maker.wait()
        assert stale.exists()
        removed = remove_stale_semaphores()
        assert stale.name in removed and live.name not in removed
        assert not stale.exists() and live.exists()
    finally:
        maker.kill()
        stale.unlink(missing_ok=True)


def test_a_model_given_up_makes_the_run_exit_non_zero_and_is_listed(data, tmp_path):
    """scheduler.max_failures=0: a trainer killed once and its model is given up; the others train on,
    the run ends with exit code 3 naming it."""
    job = Job(command(data, tmp_path / "given-up", "trainer.epochs=2", "scheduler.max_failures=0"))
    job.wait_for("formed")
    trainers = lambda: [c for c in job.children() if c.name() == "trainer"]
    deadline = time.monotonic() + 60
    while not trainers() and time.monotonic() < deadline:  # they start right after the flotilla forms
        time.sleep(0.1)
    victim = trainers()[0]
    victim.kill()
    output = job.finish()
    assert job.process.returncode == 3, output[-3000:]
    results = json.loads((tmp_path / "given-up" / "results.json").read_text())
    assert len(results["given_up"]) == 1
    given_up = results["given_up"][0]
    assert f"given up: {given_up}" in " ".join(output.split())
    models = {m["name"]: m for m in results["models"]}
    others = [m for name, m in models.items() if name != given_up]
    assert others and all(m["epochs"] == 2 for m in others)


def test_fleet_g_stopped_by_sigterm_resumes_to_the_flotilla_history_of_a_run_never_stopped(data, tmp_path):
    """scheduler=fleet_g on a cached rate table, 4 models on 2 slots (flotillas in turn): SIGTERM once the
    first epoch is saved; resumed, every model trains its epochs and the flotillas formed from the stop on
    are those of a run never stopped (the one running then formed again, the same). Three epochs: a
    flotilla starts an epoch only once the driver has handled the one before, so a stop sent after epoch
    1 is seen before epoch 3 can end, and a flotilla is still running at the stop."""
    settings = ["scheduler=fleet_g", "trainer.slots=2", "trainer.epochs=3", "rates.steps=2", "rates.warmup=1",
                f"rates.cache={tmp_path / 'rates.json'}"]
    never_stopped = run(compose_config(overrides(data, *settings)), tmp_path / "never")  # it caches the rates
    stopped = tmp_path / "stopped"

    def sigterm_after_the_first_epoch():
        state = stopped / "state" / "driver.json"
        while not (state.exists() and any(m["epochs_done"] for m in
                                          json.loads(state.read_text())["scheduler"]["groups"].values())):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=sigterm_after_the_first_epoch, daemon=True).start()
    with StopSignals() as stop:
        first = run(compose_config(overrides(data, *settings)), stopped, stop)
    assert first["interrupted"]["cause"] == "SIGTERM"
    assert any(m["epochs"] < 3 for m in first["models"])
    whole = run(compose_config(overrides(data, *settings, f"resume={stopped}")), tmp_path / "unused")
    assert "interrupted" not in whole
    epochs = lambda results: {m["name"]: len(m["val_accuracy"]) for m in results["models"]}
    assert epochs(whole) == epochs(never_stopped) == {m["name"]: 3 for m in whole["models"]}
    formed = lambda results: [(d["flotilla"], d["members"]) for d in results["scheduler"]["decisions"]
                              if d["decision"] == "FormFlotilla"]
    history = formed(whole)
    reformed = [f for i, f in enumerate(history) if i == 0 or f != history[i - 1]]
    assert len(history) == len(reformed) + 1  # the flotilla running at the stop, formed again
    assert reformed == formed(never_stopped)
    # the Gantt chart goes on: the stopped run's stints, then the resumed run's, on the scheduler's one clock
    stints = lambda results: [(b["group"], b["flotilla"], b["start"], b["end"]) for b in results["scheduler"]["gantt"]]
    before = stints(first)
    assert stints(whole)[:len(before)] == before
    assert min(start for *_, start, _ in stints(whole)[len(before):]) >= max(end for *_, end in before)


def test_a_script_without_a_main_guard_is_told_at_once_why_its_workers_fail(data, tmp_path):
    """Dask's local workers are spawned: they import the calling script, which, unguarded, runs again in
    them, where its own workers cannot start; it fails there, so they fail. The run says so as they fail (not
    after WORKERS_START_S, 120 s, whose message differs), says what to do, and leaves nothing behind."""
    script = tmp_path / "train.py"
    script.write_text(f"""import sys
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from pipeline.run import run
from tests.conftest import compose_config
run(compose_config({overrides(data, 'trainer.epochs=1')!r}), Path({str(tmp_path / 'out')!r}))
""")
    job = Job([sys.executable, str(script)])
    output = job.finish()
    assert job.process.returncode != 0
    said = [line for line in output.splitlines() if line.startswith("pipeline.runtime.errors.UserError: local Dask")]
    assert said and all("failed to start: its process ended as it began" in line and 'if __name__ == "__main__":'
                        in line for line in said), output[-3000:]
    assert gone_within(in_session(job.process.pid), 10) == [] and leftovers([job.process.pid]) == []


def in_session(session: int) -> list[psutil.Process]:
    """The processes of a session (the run's, started in its own)."""
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session:
                found.append(process)
        except ProcessLookupError:  # gone meanwhile
            pass
    return found


def test_a_close_kills_at_once_a_hub_still_waiting_for_its_peers_and_refuses_a_later_start():
    """A hub first meets the flotilla's other hubs (a rendezvous). If its driver is killed then, or another
    node's hub never starts, it waits for one that never comes; having no batch task to let finish, a close
    kills it at once, not after timeouts.drain_s (a hub a killed driver had just started lingered for the
    default 60 s into the next run at the agent). A start that comes after the close (the killed driver's
    call, still in flight at the agent) is refused: its process would have had no one to close it."""
    from pipeline.delivery.hub import HubSpec
    from pipeline.delivery.plan import HubPlan, StreamPlan
    from pipeline.orchestration.agent import NodeProcesses
    from pipeline.runtime.hang import Patience

    processes = NodeProcesses(0, drain_s=600)
    spec = HubSpec(hub=HubPlan(rank=0, stream=0, node=0, part=0), stream=StreamPlan(("A",), (0, 1), gather=True),
                   stream_ranks=((0, 1),), world=2, rendezvous=processes.rendezvous({0}), device="cpu",
                   scheduler="tcp://127.0.0.1:9", graph=None, seed=0, on_error="skip", in_flight=1, rings={},
                   record_checksums=False, shared_keys=None, sequence=0, drain_s=600, patience=Patience(),
                   collective_s=600, tls=None)
    processes.start_hub(spec)
    hub = psutil.Process(processes.hubs[0].pid)
    closer = threading.Thread(target=processes.close)
    try:
        deadline = time.monotonic() + 60
        while hub.name() != "hub":  # it has started (named itself) and goes on to wait for hub 1
            assert time.monotonic() < deadline
            time.sleep(0.05)
        closer.start()
        closer.join(30)
        assert not closer.is_alive()
        assert not hub.is_running()
        with pytest.raises(RuntimeError, match="node 0: this flotilla's processes are closed"):
            processes.start_hub(spec)
        assert processes.hubs[0].pid == hub.pid
    finally:
        if closer.is_alive():  # the failure above: it would wait out drain_s
            hub.kill()
            closer.join()
