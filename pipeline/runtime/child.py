"""One child process of a run (a hub, a trainer, a rate measurement's rank), owned as dask's Nanny owns
its worker: `Child` starts it (from `children_context`), holds the parent's ends of its two pipes,
says how it ended and stops it.

The child is called as `target(*args, to_parent=..., from_parent=...)`: it sends its messages up one
pipe and reads the parent's commands from the other. A pipe per child, not a shared queue: a child
killed while writing (SIGKILL, the OOM killer) can silence no other, and its pipe ends in EOF, which
wakes the parent as a message does. A send returns once the message is in the pipe (64 KiB on Linux)
or read: a larger one (a validation report's probabilities) waits for the parent, which reads while
the child lives, and `stop` reads on while it waits for the child to end. The driver starts no split
before it has every validation report, so a trainer's wait there costs no training (docs/benchmarks.md).
"""
from __future__ import annotations

import time
from multiprocessing import connection

from pipeline.runtime.lifetime import child_start, children_context, how_it_ended, parent_gone


class Child:
    """A child process and the parent's ends of its two pipes."""

    def __init__(self, target, args: tuple, name: str, context=None):
        """Starts `target` in a child process named `name` (ps, the driver's messages). `context`: a
        multiprocessing context other than the run's (children_context), for benchmarks that compare."""
        context = context or children_context()
        self._messages, to_parent = context.Pipe(duplex=False)
        from_parent, self._commands = context.Pipe(duplex=False)
        self.process = context.Process(target=target, args=args, name=name, daemon=True,
                                       kwargs={"to_parent": to_parent, "from_parent": from_parent})
        try:
            with child_start(name):
                self.process.start()
        except BaseException:  # not started (refused, or failed): no pipe of it is kept
            self._messages.close()
            self._commands.close()
            raise
        finally:
            to_parent.close()  # the child's ends: our copies would keep its pipe from ending with it
            from_parent.close()
        self.talking = True  # until its pipe ends: it exited, or was killed

    @property
    def name(self) -> str:
        return self.process.name

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; lifetime.how_it_ended says what a code means."""
        return self.process.exitcode

    def join(self, timeout: float | None = None) -> None:
        """Waits up to `timeout` seconds for it to end by itself."""
        self.process.join(timeout)

    def send(self, command) -> None:
        """`command` is in the child's pipe when this returns. To a child that ended it goes nowhere:
        its exit code says so, and whoever reads the codes reports it."""
        try:
            self._commands.send(command)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def messages(self) -> list:
        """What it sent so far, without waiting."""
        found = []
        while self.talking and self._messages.poll():
            try:
                found.append(self._messages.recv())
            except (EOFError, OSError):  # it ended (an OSError: it was killed in the middle of a send)
                self.talking = False
        return found

    def receive(self, timeout: float | None = None):
        """Its next message, waiting up to `timeout` seconds (None: as long as it takes); a RuntimeError
        if it ends first, a TimeoutError if the time runs out."""
        if self.talking and self._messages.poll(timeout):
            try:
                return self._messages.recv()
            except (EOFError, OSError):
                self.talking = False
        if self.talking:
            raise TimeoutError(f"{self.name}: no message in {timeout:g} s")
        self.join()
        raise RuntimeError(f"{self.name} {how_it_ended(self.exitcode)} without a word")

    def stop(self, grace_s: float = 0.0) -> list:
        """Waits up to `grace_s` for it to end, reading what it sends meanwhile (a child blocked in a send
        could not end), then kills it. Our children ignore SIGTERM (lifetime.child_started) and have
        nothing to save on the way out. Returns the messages read."""
        found, deadline = [], time.monotonic() + grace_s
        while self.process.is_alive() and (left := deadline - time.monotonic()) > 0:
            connection.wait([self.process.sentinel] + ([self._messages] if self.talking else []), left)
            found += self.messages()
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        found += self.messages()  # what is still in the pipe
        self._messages.close()
        self._commands.close()
        self.talking = False
        return found


def messages(children: list[Child], timeout: float | None) -> list:
    """What `children` sent so far, waiting up to `timeout` seconds (None: as long as it takes) for the
    first; a child that ends wakes this too."""
    talking = [child for child in children if child.talking]
    if timeout != 0 and talking:
        connection.wait([child._messages for child in talking], timeout)
    return [message for child in talking for message in child.messages()]


def tell_parent(to_parent, message) -> None:
    """In a child, its last word (a failure): sent up `to_parent` (its pipe, or what sends on it); or, the
    parent being gone (its end of the pipe closed with it, which may be what failed), this process ends as
    its parent watch would end it."""
    try:
        to_parent.send(message)
    except (BrokenPipeError, ConnectionResetError):
        parent_gone()
