"""One node of the cluster: the processes a flotilla runs there.

`NodeProcesses` owns one flotilla's hubs, trainers and the shared-memory
rings between them on one node; pipeline/orchestration/flotilla.py drives one per node. On
simulated nodes (`cluster.nodes` on a LocalCluster) it lives in the driver.
On real hosts each host runs an agent:

    python -m pipeline.node tcp://scheduler:8786 --node 1 --workers 4 --host 10.0.0.2 --key-file agent.key

It starts the host's Dask workers (resource node-<i>), registers its address
in the Dask scheduler's metadata, and serves NodeProcesses to the driver over
multiprocessing's manager protocol: the driver's calls run on that host, so
that host's hubs and trainers are its children and its rings its memory.
It serves `HostRates` too: the scheduler's rate table is measured by node
0's agent on its host's devices (`AgentRates` is the driver's end), not on
the driver's. Driver and agents share a secret given out of band (a mode 0600 file or the
environment variable PIPELINE_AGENT_KEY), never published: an agent refuses
a connection that does not prove it knows the secret. Their connections are
link.py's: TLS with the cluster's Dask certificates when it has them, and
broken once a host falls silent (timeouts.host_s).
"""
from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, replace
from multiprocessing import connection
from multiprocessing.managers import BaseManager, MakeProxyType, State, public_methods

import psutil
from hydra.utils import to_absolute_path

from pipeline.data.executor import (WORKER_MALLOC, TlsFiles, connect, node_resource, node_workers,
                                    remove_node_workers)
from pipeline.delivery.collective import LOOPBACK, LocalRendezvous, rendezvous_at, use_interface
from pipeline.delivery.hub import HubSpec, hub_main
from pipeline.delivery.messages import HubCommand, HubEvent, StopStreams
from pipeline.orchestration.link import Link, broke_the_link, serializer_for
from pipeline.runtime.child import Child, messages
from pipeline.runtime.hang import shared_out
from pipeline.runtime.lifetime import (ChildrenStopped, agent_stop_signals, child_start, children_context,
                                       refuse_once_stopped, remove_files_of, remove_shm, remove_stale_files,
                                       remove_stale_semaphores, stop_children)
from pipeline.training.group import GroupSpec, StepInHand
from pipeline.training.rates import HostHardware, Here, Measured, MeasuredBy, Measurement, RateError, measured_by_me
from pipeline.training.trainer import ReleaseMember, SaveCheckpoint, TrainerSpec, trainer_main
from pipeline.delivery.stream import MessageLayout
from pipeline.delivery.ring import Ring
from pipeline.runtime.errors import UserError
from stages.cache import cache_prefix

AGENTS = "pipeline-nodes"  # the scheduler metadata key under which agents register: node -> how to reach it
AGENT_KEY_ENV = "PIPELINE_AGENT_KEY"  # the agents' shared secret, where no key file is given
MIN_KEY_BYTES = 16  # a shorter secret is refused: it could be guessed
# `dask worker`, but for a hangup: the one that ends the agent in order (agent_stop_signals) reaches its whole
# process group, and these workers would die at once, or be started again while it stops. It stops them. (An
# ignored signal stays ignored in the processes they start.)
DASK_WORKERS_IGNORING_HANGUP = ("import signal; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
                                "from distributed.cli.dask_worker import main; main()")
log = logging.getLogger(__name__)  # an agent shows it: what its host runs


@dataclass(frozen=True)
class Laggard:
    """A trainer holding every buffer of its hub's ring of a sink: the hub cannot publish past it."""

    hub: int
    sink: str
    process: str  # its process name, trainer-<group>-<rank>
    pid: int
    state: str  # as the OS sees it: running, sleeping, stopped (SIGSTOP, a debugger), ...
    depth: int  # buffers of the ring, all held
    where: str  # its step and the members inside theirs (StepInHand.describe)
    compiling: bool  # that step compiles (trainer.compile): it takes as long as compiling does


@dataclass
class TrainerProcess:
    child: Child
    rank: int  # in its group
    readers: list[tuple[Ring, int]]  # (ring, reader index) of each sink it reads
    in_hand: StepInHand  # where its steps are


class NodeProcesses:
    """A flotilla's hubs, trainers and rings on one node. Every method is a
    call the driver can make from another host (arguments and results pickle)."""

    def __init__(self, node: int, drain_s: float, host: str = LOOPBACK, host_s: float | None = None,
                 tls: TlsFiles | None = None):
        self.node, self.host, self.tls = node, host, tls  # tls: this host's files, for its hubs' Dask clients
        self.drain_s = drain_s  # timeouts.drain_s: what a closing hub gets to finish its split
        self.host_s = host_s  # timeouts.host_s: a driver silent this long is gone (its host lost or cut off)
        self.context = children_context()
        self.abort = self.context.Event()  # tells hubs to leave between batches
        self.hubs: dict[int, Child] = {}  # hub rank -> its process
        # hub rank -> set once it serves: before, it has no batch task to let finish (it may wait in its process
        # group's rendezvous for a hub that never comes), so a close kills it at once
        self.serving: dict[int, mp.synchronize.Event] = {}
        self.trainers: dict[str, list[TrainerProcess]] = defaultdict(list)  # group -> its trainers here
        self.unread: list = []  # what trainers said as they were stopped: the next `poll` returns it
        self.rings: dict[tuple[int, str], Ring] = {}  # (hub rank, sink) -> ring
        self.local = LocalRendezvous()  # for groups with every rank on this machine: they meet through files
        # held by a close (the driver's, or the watch's on a driver that died) and by a start: a start that
        # the close did not see would outlive it, so nothing starts once closed
        self.closing = threading.Lock()
        self.closed = False

    def watch_driver(self) -> tuple[tuple[str, int], bytes]:
        """In an agent: (address, key) of a connection the driver opens and holds while the flotilla lives.
        When it breaks (the driver died: SIGKILL, the OOM killer, a lost host) or falls silent (a host
        cut off), the agent closes the flotilla's processes here; children watch their parent, and here
        that is the agent."""
        return _watch_driver(Link(self.host_s, self.tls), self.host, self._close_without_driver,
                             f"watch-driver-{self.node}")

    def _close_without_driver(self) -> None:
        if not self.closed:
            log.info("node %d: the driver is gone: closing its flotilla and the run's cache here", self.node)
            self.close()
            remove_shm(cache_prefix(os.getpid()))

    def rendezvous(self, nodes: set[int]) -> str:
        """init_method of a process group whose rank 0 runs on this node and whose ranks run on `nodes`:
        through a file where they are all on this machine (this node, or nodes simulated here on
        loopback), else at this host's address."""
        return self.local.next() if nodes == {self.node} or self.host == LOOPBACK else rendezvous_at(self.host)

    def make_ring(self, hub: int, sink: str, layout: MessageLayout, readers: int, depth: int, spare: int) -> None:
        self.rings[hub, sink] = Ring(f"h{hub}-{sink}", layout, readers, depth, self.context, spare)

    def spare_readers(self, hub: int, sink: str) -> int:
        """Readers of hub `hub`'s ring of `sink` that a joining trainer may still take (0: no such ring)."""
        ring = self.rings.get((hub, sink))
        return len(ring.spares) if ring else 0

    def start_hub(self, spec: HubSpec) -> None:
        """`spec` with this node's rings of the hub and TLS files filled in."""
        rank = spec.hub.rank
        spec = replace(spec, rings={sink: ring for (hub, sink), ring in self.rings.items() if hub == rank},
                       tls=self.tls)
        with self._open():
            self.serving[rank] = self.context.Event()
            self.hubs[rank] = Child(hub_main, (spec, self.abort, self.serving[rank]), f"hub-{rank}-node{self.node}")
        log.info("node %d: hub %d (stream %d) started, pid %d", self.node, rank, spec.hub.stream, self.hubs[rank].pid)

    def start_trainer(self, spec: TrainerSpec, hub: int, readers: dict[str, int] | None = None) -> None:
        """A trainer of `spec.group`, reading as reader `readers[sink]` of hub `hub`'s ring of each sink;
        without `readers`, a trainer that joins the running stream, as a spare reader of each ring: it
        waits for messages until `attach`ed."""
        if readers is None:
            readers = {sink: self.rings[hub, sink].take_spare() for sink in spec.group.inputs}
        taken = {sink: (self.rings[hub, sink], reader) for sink, reader in readers.items()}
        in_hand = StepInHand(self.context, spec.group, spec.setup.steps_per_epoch)
        with self._open():
            child = Child(trainer_main, (spec, {sink: ring.reader(i) for sink, (ring, i) in taken.items()}, in_hand),
                          f"trainer-{spec.group.name}-{spec.rank}")
            self.trainers[spec.group.name].append(TrainerProcess(child, spec.rank, list(taken.values()), in_hand))
        log.info("node %d: trainer %s rank %d on %s started, pid %d", self.node, spec.group.name, spec.rank,
                 spec.device, child.pid)

    def attach(self, group: str) -> None:
        """`group`'s trainers here, started as spare readers, get the hubs' messages from the next on."""
        for trainer in self.trainers.get(group, []):
            for ring, reader in trainer.readers:
                ring.attach(reader)

    def release(self, group: str, model: str) -> None:
        """`model` leaves `group`: its trainers free it before their next batch (the command is in their pipe
        when this returns, before any later batch is published)."""
        for trainer in self.trainers.get(group, []):
            trainer.child.send(ReleaseMember(model))

    def save(self, group: str, models: tuple[str, ...], epochs: int) -> None:
        """The group's rank 0 (if on this node) writes `models`' checkpoints after `epochs` epochs; it
        reports CheckpointSaved for each."""
        for trainer in self.trainers.get(group, []):
            if trainer.rank == 0:
                trainer.child.send(SaveCheckpoint(models, epochs))

    def command_hubs(self, command: HubCommand) -> None:
        for hub in self.hubs.values():
            hub.send(command)

    def hub_progress(self, timeout: float) -> list[HubEvent]:
        """The hubs' events so far, waiting up to `timeout` for the first."""
        return messages(list(self.hubs.values()), timeout)

    def poll(self, timeout: float) -> list:
        """The trainers' reports so far, waiting up to `timeout` for the first."""
        unread, self.unread = self.unread, []
        return unread + messages([t.child for trainers in self.trainers.values() for t in trainers],
                                 0 if unread else timeout)

    def hub_exit_codes(self) -> dict[int, int | None]:
        """Hub rank -> its exit code (None: running). Refused once this process stops (_exit_codes)."""
        return self._exit_codes({rank: hub.exitcode for rank, hub in self.hubs.items()})

    def trainer_exit_codes(self) -> dict[str, list[tuple[str, int | None]]]:
        """Group -> (process name, exit code) of each of its trainers here (None: running). Refused once this
        process stops (_exit_codes)."""
        return self._exit_codes({name: [(t.child.name, t.child.exitcode) for t in trainers]
                                 for name, trainers in self.trainers.items()})

    def _exit_codes(self, codes: dict) -> dict:
        """`codes`, unless this process is stopping (stop_children: an agent stopped as a host's service is)
        and so killed its children itself: its driver, told so, takes the host for lost, as it will an instant
        later when the agent's links break, instead of failing the run on a hub "killed (SIGKILL)". (Asked
        after the codes are read: a code that shows the kill was read after the stop was set.)"""
        refuse_once_stopped(f"node {self.node}'s processes", "it killed them")
        return codes

    def laggards(self) -> list[Laggard]:
        """Trainers here holding every buffer of one of their rings (read from the rings' semaphores)."""
        found = []
        trainers = [t for group in self.trainers.values() for t in group]
        for (hub, sink), ring in self.rings.items():
            for trainer, reader in ((t, reader) for t in trainers for taken, reader in t.readers if taken is ring):
                if ring.free[reader].get_value() == 0 and not ring.detached[reader]:
                    pid = trainer.child.pid
                    found.append(Laggard(hub, sink, trainer.child.name, pid, _state(pid), ring.depth,
                                         trainer.in_hand.describe(), trainer.in_hand.is_compiling))
        return found

    def remove(self, group: str) -> None:
        """Stop a group's trainers here (killed: they have nothing to save on the way out); no hub waits
        on their readers any more."""
        trainers = self.trainers.pop(group, [])
        for trainer in trainers:
            for ring, reader in trainer.readers:
                ring.detach(reader)
        for trainer in trainers:
            self.unread += trainer.child.stop()

    def join(self, timeout: float) -> None:
        """Waits up to `timeout` seconds in all for every process here to end by itself."""
        children = [t.child for trainers in self.trainers.values() for t in trainers] + list(self.hubs.values())
        for child, left in shared_out(timeout, children):
            child.join(left)

    @contextmanager
    def _open(self):
        """Held while a process starts: none starts once the flotilla's processes here are closed."""
        with self.closing:
            if self.closed:
                raise RuntimeError(f"node {self.node}: this flotilla's processes are closed (its driver closed "
                                   "them, or is gone): none starts")
            yield

    def close(self, within: float | None = None) -> None:
        """Stops everything, whatever state it is in; unlinks the rings. `within`: seconds it may take
        (a stopping run's), instead of timeouts.drain_s."""
        with self.closing:
            if not self.closed:
                self.closed = True
                self._close(self.drain_s if within is None else within / 2)

    def _close(self, drain_s: float) -> None:
        try:
            self.abort.set()
            self.command_hubs(StopStreams())
            for model in list(self.trainers):
                self.remove(model)
            for ring in self.rings.values():  # no hub waits on a trainer that is gone
                for reader in range(ring.consumers):
                    ring.detach(reader)
            for (rank, hub), left in shared_out(drain_s, self.hubs.items()):
                # a hub in the middle of a split lets its batch tasks finish first (what it says now, the run no
                # longer reads); one not yet serving has none
                hub.stop(left if self.serving[rank].is_set() else 0)
                remove_files_of(hub.pid)  # hand-off files of batch tasks it never took
        finally:
            for hub in self.hubs.values():  # stopped already, unless the above raised
                hub.stop()
            for ring in self.rings.values():
                ring.close()
            self.local.close()


@dataclass(frozen=True)
class RatesFailed:
    """An agent's answer to a measurement that failed on its host: the error, with the process that ran it."""

    by: MeasuredBy
    error: str  # the message; for an unexpected error, its traceback
    user_error: bool  # a request the host cannot meet (RateError: no such GPU, ...), not a crash


class HostRates:
    """In an agent: rate measurement on this host for a driver elsewhere (pipeline/training/rates.py):
    the ranks are the agent's children, on this host's devices. The driver holds `watch_driver`'s link
    while it measures; when the link breaks, a measurement under way is abandoned and its ranks killed."""

    def __init__(self, node: int, host: str, host_s: float, tls: TlsFiles | None):
        self.node, self.host, self.link = node, host, Link(host_s, tls)  # tls: this host's files
        self.here = Here(abandon=threading.Event())

    def watch_driver(self) -> tuple[tuple[str, int], bytes]:
        return _watch_driver(self.link, self.host, self.here.abandon.set, f"watch-rates-driver-{self.node}")

    def hardware(self, how: Measurement) -> HostHardware | RatesFailed:
        """describe_hardware of this host: the rate cache's key."""
        return self._answer(lambda: self.here.hardware(how))

    def measure(self, group: GroupSpec, slot_counts: list[int], how: Measurement) -> Measured | RatesFailed:
        log.info("node %d: measuring %s on %s slot(s) of %s", self.node, group.name,
                 ", ".join(map(str, slot_counts)), how.devices[:max(slot_counts, default=0)])
        answer = self._answer(lambda: self.here.measure(group, slot_counts, how))
        log.info("node %d: %s: %s", self.node, group.name, f"failed: {answer.error.partition(chr(10))[0]}" if
                 isinstance(answer, RatesFailed) else
                 ", ".join(f"{p.images_per_s:.1f} images/s on {k}" for k, p in answer.paces.items()))
        return answer

    @staticmethod
    def _answer(work):
        try:
            return work()
        except RateError as error:
            return RatesFailed(measured_by_me(), str(error), user_error=True)
        except Exception as error:  # a rank failed (its traceback is in the message), or a bug here
            # unless the agent is stopping: it killed the ranks itself (its driver takes the host for lost)
            refuse_once_stopped("this host's rate measurement", "it killed its ranks")
            text = str(error) if isinstance(error, RuntimeError) else traceback.format_exc()
            return RatesFailed(measured_by_me(), text, user_error=False)


def _state(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return "gone"


AGENT_STOPPING = "it is stopping"  # why a host is lost whose agent refused a call as it stopped


class HostLost(RuntimeError):
    """A node's agent no longer answers the driver: its host is gone (killed, powered off, cut off)."""

    def __init__(self, address: str, why: str, node: int | None = None):
        whose = "the agent" if node is None else f"node {node}'s agent"
        super().__init__(f"{whose} at {address} does not answer ({why})")
        self.address, self.why = address, why


def _proxy_type(served: type) -> type:
    """The driver's proxy of a `served` object in an agent, made by an `_Agent`: its connections to the agent
    are the manager's Link, and a broken one is HostLost, as is every call after it; so is a call the agent
    refused as it stops (ChildrenStopped: its links break an instant later)."""

    class Proxy(MakeProxyType(f"{served.__name__}Proxy", public_methods(served))):
        def _callmethod(self, methodname, args=(), kwds={}):
            manager = self._manager
            if manager.lost is None:
                try:
                    return super()._callmethod(methodname, args, kwds)
                except ChildrenStopped:
                    manager.lost = AGENT_STOPPING
                except (EOFError, OSError) as err:
                    if not broke_the_link(err):
                        raise  # the agent's method raised it: the link is fine
                    manager.lost = (f"silent for timeouts.host_s={manager.link.host_s:g} s"
                                    if isinstance(err, TimeoutError) else f"{type(err).__name__}: {err}".rstrip(": "))
                manager._state.value = State.SHUTDOWN  # its proxies' garbage collection must not try to reach it
            host, port = self._token.address
            raise HostLost(f"{host}:{port}", manager.lost) from None

    return Proxy


class _Agent(BaseManager):
    """multiprocessing's manager protocol: the driver creates NodeProcesses (a flotilla's processes on the
    node) and HostRates (the rate measurement) in an agent and calls them, through connections made as
    `link` says (TLS or not; how long a silent host is waited for)."""

    def __init__(self, address, authkey, link: Link):
        super().__init__(address=address, authkey=authkey, serializer=serializer_for(link))
        self.link = link
        self.lost: str | None = None  # why the agent is taken as lost: its proxies' first broken link


_Agent.register("NodeProcesses", NodeProcesses, proxytype=_proxy_type(NodeProcesses))
_Agent.register("HostRates", HostRates, proxytype=_proxy_type(HostRates))


def node_processes(node: int, agents: dict[int, dict], drain_s: float, key: bytes | None,
                   tls: TlsFiles | None, host_s: float):
    """A flotilla's processes on `node`: in the agent registered for it (met with the agents' secret
    `key`, over TLS with `tls`; lost when silent for `host_s`), else in this process (its hubs' Dask clients
    use `tls`); and, with an agent, the link to hold open while they live (NodeProcesses.watch_driver)."""
    agent = agents.get(node)
    if agent is None:
        return NodeProcesses(node, drain_s, tls=tls), None
    manager, host = _connect(node, agent, key, Link(host_s, tls))
    try:
        processes = manager.NodeProcesses(node, drain_s, host, host_s)
    except ChildrenStopped:
        raise HostLost(agent["address"], AGENT_STOPPING, node) from None
    address, link_key = processes.watch_driver()
    return processes, manager.link.connect(address, authkey=link_key)


class AgentRates:
    """The driver's end of a node agent's HostRates: a RateHost (pipeline/training/rates.py) whose
    measurements run on the agent's host. It connects on first use (as `link` says) and holds the agent's
    watch link until closed; an error there is raised here, naming the agent and its host."""

    def __init__(self, node: int, agent: dict, key: bytes, link: Link):
        self.node, self.agent, self.key, self.link = node, agent, key, link
        self.remote = None  # the agent's HostRates, once connected
        self.watch: connection.Connection | None = None  # held open while it measures

    def hardware(self, how: Measurement) -> HostHardware:
        return self._result(self._host().hardware(replace(how, where=None)))

    def measure(self, group: GroupSpec, slot_counts: list[int], how: Measurement) -> Measured:
        return self._result(self._host().measure(group, slot_counts, replace(how, where=None)))

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()  # the agent's watch ends; nothing of ours runs there any more
        self.remote = self.watch = None

    def _host(self):
        if self.remote is None:
            manager, host = _connect(self.node, self.agent, self.key, self.link)
            self.remote = manager.HostRates(self.node, host, self.link.host_s)
            address, link_key = self.remote.watch_driver()
            self.watch = self.link.connect(address, authkey=link_key)
        return self.remote

    def _result(self, answer):
        if isinstance(answer, RatesFailed):
            kind = RateError if answer.user_error else RuntimeError
            raise kind(f"rate measurement by node {self.node}'s agent at {self.agent['address']} (host "
                       f"{answer.by.host}, pid {answer.by.pid}) failed: {answer.error}")
        return answer


@contextmanager
def agent_rates(agents: dict[int, dict], key: bytes | None, link: Link):
    """Where a run measures its rates: node 0's agent (reached as `link` says) when the nodes have agents
    (they are alike, so one host's rates are every node's), else None (the driver's own devices)."""
    if not agents:
        yield None
        return
    rates = AgentRates(0, agents[0], key, link)
    try:
        yield rates
    finally:
        rates.close()


def _connect(node: int, agent: dict, key: bytes | None, link: Link) -> tuple[_Agent, str]:
    """A manager connected to `node`'s agent through `link`, and that agent's host."""
    host, port = agent["address"].rsplit(":", 1)
    manager = _Agent((host, int(port)), key, link)
    try:
        manager.connect()
    except mp.AuthenticationError:
        raise UserError(f"node {node}'s agent at {agent['address']} refused this driver's secret: give the "
                        "driver the secret its agents were started with (cluster.agent_key_file or "
                        f"{AGENT_KEY_ENV})") from None
    except ssl.SSLError as err:  # the handshake failed (an agent that went away is EOFError)
        raise UserError(f"node {node}'s agent at {agent['address']} and this driver do not accept each other's "
                        f"TLS certificate ({err.reason or err}): give both certificates signed by the cluster's "
                        "CA, the driver in cluster.tls.*, the agent in --tls-*") from None
    except (OSError, EOFError) as err:
        raise HostLost(agent["address"], f"{err or type(err).__name__}; start it again on its host: "
                                         f"python -m pipeline.node <scheduler> --node {node}", node) from None
    return manager, host


def _watch_driver(link: Link, host: str, on_gone, name: str) -> tuple[tuple[str, int], bytes]:
    """In an agent: (address, key) of a connection (made as `link` says) for the driver to open and hold;
    `on_gone` runs once it breaks (the driver closed it, or died: SIGKILL, the OOM killer, a lost host)
    or once the driver's host has not answered for link.host_s (cut off)."""
    key = os.urandom(16)
    listener = link.listen((host, 0), authkey=key)
    threading.Thread(target=_wait_for_break, args=(listener, on_gone), name=name, daemon=True).start()
    return listener.address, key


def _wait_for_break(listener, on_gone) -> None:
    try:
        with listener, listener.accept() as link:
            link.recv()  # the driver sends nothing: this returns when its end closes or falls silent
    except (EOFError, OSError, mp.AuthenticationError):
        pass
    on_gone()


def agent_key(key_file: str | None, option: str) -> bytes:
    """The secret driver and agents share, given out of band: the file `key_file` (readable by its
    owner only; relative, from where the command ran; `option` names where it was given, for errors), else
    PIPELINE_AGENT_KEY."""
    if key_file:
        try:
            with open(path := to_absolute_path(key_file), "rb") as file:
                mode = os.fstat(file.fileno()).st_mode & 0o777
                key, source = file.read().strip(), f"{option}={key_file}"
        except OSError as err:
            raise UserError(f"{option}={key_file}: cannot read the agents' secret ({path}: {err.strerror}); give "
                            "the path of the key file") from None
        if mode & 0o077:
            raise UserError(f"{option}={key_file} is mode {mode:o}: others may read the agents' secret; make it "
                            f"private with: chmod 600 {key_file}")
    else:
        key, source = os.environ.get(AGENT_KEY_ENV, "").strip().encode(), AGENT_KEY_ENV
    if not key:
        raise UserError(f"node agents need a secret shared with the driver: give {option}=<file> (mode 0600) or set "
                        f"{AGENT_KEY_ENV}, the same one on every host; make one with: python -c 'import secrets; "
                        "print(secrets.token_hex(32))' > agent.key && chmod 600 agent.key")
    if len(key) < MIN_KEY_BYTES:
        raise UserError(f"{source}: the agents' secret has {len(key)} bytes, fewer than {MIN_KEY_BYTES}: make a "
                        "longer one with: python -c 'import secrets; print(secrets.token_hex(32))'")
    return key


def _answers(address: str, timeout_s: float = 5) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def registered_agents(client) -> dict[int, dict]:
    """Node -> agent registered with the client's scheduler ({} when nodes are simulated here)."""
    found = client.get_metadata(AGENTS, default={}) or {}
    return {int(node): agent for node, agent in found.items() if agent}


class NodeAgents:
    """The driver's view of the node agents registered with the Dask scheduler: `agents` (node -> how to
    reach its agent) is the dict every flotilla reads, kept up to date here as nodes are lost and return."""

    def __init__(self, client, agents: dict[int, dict]):
        self.client, self.agents = client, agents

    def node_at(self, address: str) -> int:
        """The node whose agent is at `address`."""
        return next(node for node, agent in self.agents.items() if agent["address"] == address)

    def lose(self, node: int) -> None:
        """Node `node`'s host is lost: its Dask workers are removed before anything new waits for them."""
        remove_node_workers(self.client, node)

    def returned(self, node: int) -> dict | None:
        """The agent of lost node `node`, if it has registered anew since (an agent started again, or the
        same one with its Dask workers started again: it registers once they have joined) and answers; it
        replaces the lost one."""
        agent = registered_agents(self.client).get(node)
        if agent is None or agent == self.agents[node] or not _answers(agent["address"], timeout_s=1):
            return None
        self.agents[node] = agent
        return agent


def serve(scheduler: str, node: int, workers: int, threads: int, host: str, interface: str, key: bytes,
          host_s: float, tls: TlsFiles | None = None) -> None:
    """Run this host as `node` until stopped (Ctrl-C, SIGTERM, a hangup: agent_stop_signals); only a driver
    holding `key` is served, and a driver whose host has answered nothing for `host_s` is served no more (the
    connections break, the threads serving them end). Everything listens on `host`, but process groups
    between hosts, whose traffic goes through `interface` (their sockets on its address; their store on
    `host`)."""
    import torch

    log.addHandler(logging.StreamHandler(sys.stdout))
    log.setLevel(logging.INFO)
    agent_stop_signals()
    left = remove_stale_files() + remove_stale_semaphores()  # of an agent killed outright here, and its children
    if left:
        log.info("node %d: removed what dead processes left in /dev/shm and %s: %s", node, tempfile.gettempdir(),
                 ", ".join(left))
    use_interface(interface)  # before the fork server starts: every child inherits it
    children_context()  # the fork server of the flotillas' children imports torch while the workers start

    class Serving(_Agent):  # with this host's TLS files: the driver's links, the hubs' Dask clients
        pass

    served = ServedFlotillas(node, tls)
    Serving.register("NodeProcesses", served.node_processes)
    Serving.register("HostRates", functools.partial(HostRates, tls=tls))
    server = Serving((host, 0), key, Link(host_s, tls)).get_server()
    resource = f"{node_resource(node)}={threads}"
    with connect(scheduler, tls) as client:
        serving = registered_agents(client).get(node)
    if serving and _answers(serving["address"]):  # an entry whose agent is gone is replaced
        raise SystemExit(f"node {node} is already served by the agent at {serving['address']}: "
                         "give each host its own --node")
    tls_options = ["--tls-ca-file", tls.ca_file, "--tls-cert", tls.cert, "--tls-key", tls.key] if tls else []
    dask_workers = HostWorkers(scheduler, tls, node, workers, [
        sys.executable, "-c", DASK_WORKERS_IGNORING_HANGUP, scheduler, "--nworkers", str(workers), "--nthreads",
        str(threads), "--host", host, "--resources", resource, "--name", f"n{node}", "--no-dashboard",
        "--dashboard-address", f"{host}:0", *tls_options], {  # its HTTP server (health) on `host` too
        # the secret is not published: the driver has it already
        "address": f"{host}:{server.address[1]}", "pid": os.getpid(), "gpus": torch.cuda.device_count(),
        "gpu_memory": torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None})
    try:
        dask_workers.start()
        print(f"node {node}: {workers} Dask worker(s) x {threads} thread(s) ({resource}); serving flotillas at "
              f"{host}:{server.address[1]}; process groups through {interface}", flush=True)
        threading.Thread(target=dask_workers.keep, name="keep-dask-workers", daemon=True).start()
        server.serve_forever()
    finally:
        try:
            served.leave()
            dask_workers.stop()  # needs the scheduler, which may be gone
        finally:
            remove_shm(cache_prefix(os.getpid()))  # the stores of runs this host served


class ServedFlotillas:
    """In an agent: the flotillas' processes on this host (NodeProcesses) that drivers' calls made, each
    call served in a thread of its own; `leave` ends them as the agent stops."""

    def __init__(self, node: int, tls: TlsFiles | None):
        self.node, self.tls = node, tls
        self.served = weakref.WeakSet()

    def node_processes(self, *args, **kwargs) -> NodeProcesses:
        """A flotilla's processes here (the driver's `NodeProcesses` call); refused (ChildrenStopped) once the
        agent stops, as a child's start is: every flotilla made is in `served` when `leave` reads it."""
        with child_start(f"node {self.node}'s flotilla"):
            processes = NodeProcesses(*args, tls=self.tls, **kwargs)
            self.served.add(processes)
        return processes

    def leave(self) -> None:
        """As the agent stops: the processes of the runs it serves end now, their rings and rendezvous
        folders go, and their drivers take this host for lost (as one killed: its models resume from their
        checkpoints elsewhere). Every child is killed first, and neither a child nor a flotilla starts after
        (stop_children): they ignore SIGTERM, so multiprocessing's exit would wait for them for ever, and a
        close under way (its driver gone: its hubs get timeouts.drain_s) would hold a flotilla's close back
        as long."""
        stop_children()
        flotillas = list(self.served)  # none is added any more
        still_open = sum(not processes.closed for processes in flotillas)
        for processes in flotillas:  # one already closing (its driver gone): its close is waited for, so it ends
            processes.close(within=0)  # before the process does (its thread is a daemon)
        if still_open:
            log.info("node %d: stopping: closed the processes of %d flotilla(s) here; their runs take this node "
                     "for lost", self.node, still_open)


class HostWorkers:
    """In an agent: its host's Dask workers (resource node-<i>), and the agent's entry in the scheduler's
    metadata, which names their process. The driver has the scheduler remove a lost host's workers
    (NodeAgents.lose); should that host come back (cut off, then not), they hear so and close. The agent then
    starts them again and registers anew, and the driver, finding a new entry for the node that answers
    (NodeAgents.returned), takes the host back."""

    RETRY_S = 5  # between attempts to start them again, while the scheduler cannot be reached

    def __init__(self, scheduler: str, tls: TlsFiles | None, node: int, count: int, command: list[str], entry: dict):
        self.scheduler, self.tls, self.node, self.count = scheduler, tls, node, count
        self.command, self.entry = command, entry
        self.process: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self.starting = threading.Lock()  # no process is started once the agent stops

    def start(self) -> bool:
        """Start the workers, wait until they have joined, and register the agent with them (False: the
        agent stops, nothing was started)."""
        with self.starting:
            if self.stopping.is_set():
                return False
            self.process = subprocess.Popen(self.command, env={**os.environ, **WORKER_MALLOC})
        try:
            with connect(self.scheduler, self.tls) as client:
                _wait_for_workers(client, self.node, self.count)
                client.set_metadata([AGENTS, str(self.node)], {**self.entry, "workers_pid": self.process.pid})
        except BaseException:
            self._end_process()
            raise
        return True

    def keep(self) -> None:
        """Start them again whenever they end before the agent stops (a thread of the agent's)."""
        while not self.stopping.is_set():
            code = self.process.wait()
            if self.stopping.is_set():
                return
            log.info("node %d: its Dask workers ended (exit code %s; the scheduler removed them?): starting them "
                     "again", self.node, code)
            while not self.stopping.is_set():
                try:
                    if self.start():
                        log.info("node %d: its Dask workers joined again (pid %d)", self.node, self.process.pid)
                    break
                except OSError as err:  # the scheduler cannot be reached yet, or they did not join in time
                    log.info("node %d: its Dask workers could not join (%s): trying again in %d s", self.node,
                             err, self.RETRY_S)
                    self.stopping.wait(self.RETRY_S)

    def stop(self) -> None:
        """Unregister the agent and end its workers (those of a start under way too)."""
        with self.starting:
            self.stopping.set()
        try:
            with connect(self.scheduler, self.tls) as client:
                client.set_metadata([AGENTS, str(self.node)], None)
        finally:
            self._end_process()

    def _end_process(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(60)


def _wait_for_workers(client, node: int, count: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len(node_workers(client, node)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} Dask worker(s) with resource {node_resource(node)} did not join in "
                               f"{timeout_s:.0f} s")
        time.sleep(0.2)
