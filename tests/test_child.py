"""One class owns a child process (pipeline/runtime/child.py): its messages, its commands, its end."""
import multiprocessing as mp
import os
import signal

import pytest

from pipeline.runtime.child import Child, messages
from pipeline.runtime.lifetime import ChildrenStopped, stop_children

BIG = 4 * 2**20  # bytes: far more than a pipe holds (64 KiB), so the send waits for the parent to read


def _echo(*, to_parent, from_parent):
    """Sends back each command until told "bye"."""
    for command in iter(from_parent.recv, "bye"):
        to_parent.send(command)


def _say_then_die(*, to_parent, from_parent):
    to_parent.send("last words")
    os.kill(os.getpid(), signal.SIGKILL)


def _send_big_then_exit(*, to_parent, from_parent):
    to_parent.send(b"x" * BIG)


@pytest.fixture
def children():
    started = []
    yield started
    for child in started:
        child.stop()


def test_each_child_s_messages_come_and_a_killed_one_wakes_the_parent_and_silences_no_other(children):
    """Commands go down, messages come up; a child killed outright ends its pipe, which wakes `messages`
    (no timeout spent), and is named with how it died, while the other goes on. The mistakes it catches:
    a shared channel whose lock the killed child held, a dead child whose pipe the parent's own copy of
    the writing end keeps open (the wait would run to its timeout)."""
    echo = Child(_echo, (), "test-echo")
    dying = Child(_say_then_die, (), "test-dying")
    children += [echo, dying]
    said = messages([dying], timeout=30)  # its word, and perhaps already the end of its pipe
    said += messages([dying], timeout=30)  # the end of its pipe, if not
    dying.process.join()
    assert said == ["last words"] and not dying.talking and dying.exitcode == -signal.SIGKILL
    echo.send("ping")
    assert messages(children, timeout=30) == ["ping"]
    echo.send("bye")
    assert echo.stop(30) == [] and echo.exitcode == 0


def test_stop_reads_a_large_last_message_so_that_the_child_can_end(children):
    """A child whose last message is larger than its pipe holds can end only once the parent reads it:
    `stop` reads while it waits, and returns the message. The mistake it catches: a stop that only waits
    then kills (the child, blocked in its send, would be killed and its message lost)."""
    child = Child(_send_big_then_exit, (), "test-big")
    children.append(child)
    assert child.stop(60) == [b"x" * BIG] and child.exitcode == 0


def test_a_child_that_ends_without_a_word_is_named_with_how_and_a_command_to_it_goes_nowhere(children):
    """`receive` names a child that died without a message with how it ended; a command sent to it
    afterwards is not an error (its exit code is how the parent learns of its end)."""
    child = Child(_say_then_die, (), "test-dying")
    children.append(child)
    assert child.receive(30) == "last words"
    with pytest.raises(RuntimeError, match=r"test-dying was killed \(SIGKILL\).* without a word"):
        child.receive(30)
    child.send("anyone there?")


def _ignore_sigterm_and_echo(*, to_parent, from_parent):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as our children do (lifetime.child_started)
    _echo(to_parent=to_parent, from_parent=from_parent)


def _ranks_killed():
    raise RuntimeError("rates-g-0 was killed (SIGKILL)")  # as a measurement whose ranks were killed fails


def _stop_children_then_start_one(to_test) -> None:
    """In a process of its own (stop_children is for good): a child that ignores SIGTERM and waits for
    commands, a node's processes with it as their hub, stop_children, then another start, the node's exit
    codes and a failed rate measurement's answer. Sends what it saw. (Spawned children: a fork server would
    import torch first.)"""
    from pipeline.orchestration.agent import HostRates, NodeProcesses

    spawn = mp.get_context("spawn")
    waiting = Child(_ignore_sigterm_and_echo, (), "test-waiting", spawn)
    waiting.send("ping")
    assert waiting.receive(60) == "ping"  # it runs, SIGTERM ignored
    node = NodeProcesses(1, drain_s=1.0)
    node.hubs[0] = waiting
    assert node.hub_exit_codes() == {0: None}
    stop_children()
    waiting.process.join(30)
    refused = []
    for start_or_answer in (lambda: Child(_echo, (), "test-late", spawn), node.hub_exit_codes,
                            node.trainer_exit_codes, lambda: HostRates._answer(_ranks_killed)):
        try:
            start_or_answer()
            refused.append(None)
        except ChildrenStopped as err:
            refused.append(str(err))
    node.hubs.clear()  # (killed already)
    node.close()  # its rendezvous folder
    to_test.send((waiting.exitcode, refused, [child.name for child in mp.active_children()]))


def test_a_stopping_process_kills_its_children_and_starts_none_after():
    """stop_children (a node agent stopping) kills every child at once, though ours ignore SIGTERM, and a
    start after it, from whatever thread (a call the agent still serves), is refused, naming the child.
    The mistake it catches: a child started in the instant after the kill, which multiprocessing's exit
    would wait for as long as it lives. A node's exit codes are refused after it too: its driver would
    have failed the run on a hub "killed (SIGKILL)", by the agent, had it asked before the agent's links
    broke (seen under load: the driver exited 1 instead of taking the host for lost); so is a rate
    measurement's failure (its ranks killed, or refused a start)."""
    spawn = mp.get_context("spawn")  # not the test process: it stops for good
    received, to_test = spawn.Pipe(duplex=False)
    process = spawn.Process(target=_stop_children_then_start_one, args=(to_test,))
    process.start()
    to_test.close()
    try:
        assert received.poll(120), "the process said nothing"
        exitcode, refused, left = received.recv()
    finally:
        process.join(30)
        process.kill()
    assert exitcode == -signal.SIGKILL
    assert refused == ["test-late: this process is stopping; it starts no child",
                       *["node 1's processes: this process is stopping; it killed them"] * 2,
                       "this host's rate measurement: this process is stopping; it killed its ranks"] and left == []
    assert process.exitcode == 0


def test_joining_a_node_s_processes_and_a_flotilla_s_nodes_shares_one_timeout(monkeypatch):
    """NodeProcesses.join and Flotilla.join wait `timeout` in all, not `timeout` for each process or node:
    here every child (and node) takes all the time it is given, on a fake clock. The mistake it catches:
    the whole timeout given to each in turn (a run's exit could wait timeouts.exit_s times its processes)."""
    from types import SimpleNamespace

    from pipeline.orchestration import agent as agent_module, flotilla as flotilla_module
    from pipeline.runtime import hang

    clock = [0.0]
    monkeypatch.setattr(hang, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    class Lingering:
        """A child or node that does not end: a join waits out the time it is given."""

        def __init__(self):
            self.given = []

        def join(self, timeout):
            self.given.append(timeout)
            clock[0] += timeout

    trainers, hub = [Lingering(), Lingering()], Lingering()
    processes = object.__new__(agent_module.NodeProcesses)  # join reads only its trainers and hubs
    processes.trainers = {"g": [SimpleNamespace(child=child) for child in trainers]}
    processes.hubs = {0: hub}
    processes.join(5.0)
    assert [child.given for child in trainers + [hub]] == [[5.0], [0], [0]]
    nodes = [Lingering(), Lingering()]
    flotilla = object.__new__(flotilla_module.Flotilla)  # join reads only its nodes
    flotilla.nodes = dict(enumerate(nodes))
    flotilla.join(3.0)
    assert [node.given for node in nodes] == [[3.0], [0]]
