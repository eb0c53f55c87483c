"""Several hosts for real: a Dask scheduler, one node agent per host (python -m pipeline.node) and the
driver, each on a test host of its own (a network namespace with its own address, tests/hosts.py)."""
import glob
import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.data.executor import scheduler_workers
from pipeline.delivery.collective import LOOPBACK
from pipeline.orchestration.link import Link
from pipeline.orchestration.agent import AGENT_KEY_ENV
from pipeline.runtime.errors import UserError
from stages.cache import cache_prefix
from tests.conftest import compose_config
from tests.hosts import Hosts, connected, dask_scheduler, listening
from tests.test_lifetime import gone_within
from tests.test_topology import MODELS, PACED, assert_every_batch_once_in_order_bit_identical

AGENT_KEY = "0123456789abcdef" * 2  # the secret driver and agents share
HOSTS = ["scheduler", "node0", "node1", "driver"]


def _agent_command(hosts: Hosts, scheduler: str, node: int, tls_files) -> list[str]:
    """Node `node`'s agent on its host, given no --host: it takes the address it reaches the scheduler from.
    A driver silent for 4 s is gone for it (--host-s), as for the cut-off run's driver (timeouts.host_s)."""
    return hosts.command(f"node{node}", [
        sys.executable, "-m", "pipeline.node", scheduler, "--node", str(node), "--workers", "1", "--host-s", "4",
        "--tls-ca-file", tls_files.ca_file, "--tls-cert", tls_files.cert, "--tls-key", tls_files.key])


@pytest.mark.slow
def test_node_agents_on_hosts_of_their_own(tiny_dataset, tmp_path, tls, alone):
    """Two agents, the scheduler and the driver, each on a host of its own (its own address; the host name
    resolves to loopback there, as on most Linux hosts). Each agent takes the address it reaches the
    scheduler from and that address's interface for its process groups. The run, given only the scheduler's
    address, its TLS files and the secret, finds the agents; each starts its node's hubs and trainers;
    all_shared's all-gather crosses the hosts; every batch reaches every trainer once, in order, bit-identical
    (CRCs); the agents' rings are gone after the run. They exit cleanly, one on SIGTERM, the other on a hangup
    (its ssh session dropped) with its whole process group, which it takes with it. While a flotilla runs, nothing
    listens beyond the agents' own addresses (and loopback), and nothing at the driver. An agent refuses a
    driver without the secret, which was never published."""
    from distributed import Client

    from pipeline.orchestration.agent import _Agent, node_processes, registered_agents

    security, tls_files = tls
    key_file = tmp_path / "agent.key"
    key_file.write_text(AGENT_KEY)
    key_file.chmod(0o600)
    env = {**os.environ, AGENT_KEY_ENV: AGENT_KEY, "PYTHONUNBUFFERED": "1"}  # prints and logging in their order
    with Hosts(HOSTS) as hosts, dask_scheduler(hosts, tmp_path, tls_files) as address, \
            Client(address, security=security, timeout="30s") as client:
        logs = [open(tmp_path / f"agent{node}.log", "w+") for node in (0, 1)]
        agents = [subprocess.Popen(_agent_command(hosts, address, node, tls_files), stdout=log,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)  # a host: a group
                  for node, log in enumerate(logs)]
        try:
            deadline = time.monotonic() + 180
            said = lambda: [(tmp_path / f"agent{n}.log").read_text() for n in (0, 1)]
            # registered, and then each says so (a line printed after it registers)
            while len(registered_agents(client)) < 2 or not all("serving flotillas at" in text for text in said()):
                assert time.monotonic() < deadline and all(a.poll() is None for a in agents), said()
                time.sleep(0.2)
            registered = registered_agents(client)
            pids = {node: agent["pid"] for node, agent in registered.items()}
            assert pids == {0: agents[0].pid, 1: agents[1].pid}
            assert all(set(agent) == {"address", "pid", "gpus", "gpu_memory", "workers_pid"}
                       for agent in registered.values())
            assert [registered[n]["address"].rsplit(":", 1)[0] for n in (0, 1)] == [hosts.addresses["node0"],
                                                                                   hosts.addresses["node1"]]
            assert all("process groups through eth0" in (tmp_path / f"agent{n}.log").read_text() for n in (0, 1))
            host, port = registered[0]["address"].rsplit(":", 1)
            for wrong in (b"not the secret at all", None):  # None: this process's own random authkey
                with pytest.raises(mp.AuthenticationError):
                    _Agent((host, int(port)), wrong, Link(30, tls_files)).connect()
            with pytest.raises(UserError, match="node 0's agent at .* refused this driver's secret"):
                node_processes(0, registered, 1.0, b"not the secret at all", tls_files, 30)
            twice = subprocess.run(_agent_command(hosts, address, 0, tls_files), capture_output=True, text=True,
                                   timeout=120, env=env)
            assert twice.returncode == 1 and "node 0 is already served by the agent at" in twice.stderr
            overrides = ["+ensemble=caltech256", f"ensemble.models={MODELS}", "topology=all_shared",
                         f"dataset.root={tiny_dataset}", "dataset.synthetic=never", "pipeline.batch_size=16",
                         "pipeline.image_size=32", "pipeline.alt_image_size=24", f"cluster.address={address}",
                         "cluster.nodes=2", f"cluster.tls.ca_file={tls_files.ca_file}",
                         f"cluster.tls.cert={tls_files.cert}", f"cluster.tls.key={tls_files.key}",
                         f"cluster.agent_key_file={key_file}", "trainer.slots=4", "trainer.consume_only=true"]
            run = [*overrides, "trainer.epochs=2", "trainer.record_checksums=true"]
            driver = subprocess.run(hosts.command("driver", [sys.executable, "-m", "pipeline", *run,
                                                             f"hydra.run.dir={tmp_path / 'out'}"]),
                                    capture_output=True, text=True, timeout=300)
            assert driver.returncode == 0, driver.stdout + driver.stderr
            results = json.loads((tmp_path / "out" / "results.json").read_text())
            assert_every_batch_once_in_order_bit_identical(compose_config(run), results)
            # One cache per host: each holds the shares its node made in epoch 1 (about half of epoch 2's).
            first, second = results["pipeline"]["cache_hit_rate_by_epoch"]
            assert first == 0 and 0.25 < second < 0.75
            assert len(results["delivery"]["received"]) == 4
            (hubs,) = [info["hubs"] for info in results["delivery"]["flotillas"].values()]
            assert {hub["node"] for hub in hubs.values()} == {0, 1}
            # The all-gather crossed the hosts: each hub sent the other its share of every batch of the 2 epochs
            # (4 training, 1 validation): 8 of the 16 images of each stream, their labels, a 24-byte header.
            share = 24 + 8 * (32 * 32 * 3 + 8) + 8 * (24 * 24 * 3 + 8)
            assert [hub["sent_bytes"] for hub in hubs.values()] == [2 * (4 + 1) * share] * 2
            # Each node's processes were started by its agent: a hub each, and the trainers of the slots the
            # scheduler gave that node.
            slots = {d["group"]: [int(n) for n in re.findall(r"node=(\d+)", d["slots"])]
                     for d in results["scheduler"]["decisions"] if d["decision"] == "AssignSlots"}
            for node in (0, 1):
                started = (tmp_path / f"agent{node}.log").read_text()
                hubs_here = re.findall(rf"node {node}: hub (\d+)", started)
                trainers_here = re.findall(rf"node {node}: trainer (\w+) rank (\d+)", started)
                assert [hubs[rank]["node"] for rank in hubs_here] == [node], started
                assert sorted(trainers_here) == sorted((model, str(rank)) for model, nodes in slots.items()
                                                       for rank, n in enumerate(nodes) if n == node), started
            assert not [name for name in os.listdir("/dev/shm")
                        if name.startswith(tuple(f"ensemble-{pid}-" for pid in pids.values()))]
            _rates_are_measured_by_node_0s_agent(hosts, overrides, registered, agents, tls_files, tmp_path)
            _a_driver_killed_outright_leaves_nothing_running_at_the_agents(hosts, overrides, agents, tmp_path)
            with alone():  # the lost host's leftovers, which another test's run starting would remove first
                _a_lost_host_fails_its_models_and_the_run_goes_on_without_it(
                    hosts, overrides, agents, client, tmp_path, _agent_command(hosts, address, 1, tls_files), env)
            _a_host_cut_off_is_lost_after_timeouts_host_s(hosts, overrides, agents, client, tmp_path)
            _a_run_started_while_a_host_is_cut_off_trains_on_the_others(hosts, overrides, client, tmp_path)
            _a_run_no_slot_left_can_take_stops_with_exit_5_and_resumes_once_the_host_is_back(
                hosts, overrides, agents, client, tmp_path, _agent_command(hosts, address, 1, tls_files), env)
        finally:
            # node 0's agent is stopped as systemd stops it; node 1's as an ssh session's hangup does: the signal
            # reaches the agent's whole process group (its Dask workers, its fork server) as a terminal sends it
            agents[0].send_signal(signal.SIGTERM)
            node1_logs = {path: path.stat().st_size for path in tmp_path.glob("agent1*.log")}  # each agent of node 1's
            node1_group = _process_group(agents[1].pid)
            if agents[1].poll() is None:  # (a check above may have failed with node 1's agent killed)
                os.killpg(agents[1].pid, signal.SIGHUP)
            codes = [agent.wait(60) for agent in agents]
            for log in logs:
                log.close()
        assert codes == [0, 0]
        assert registered_agents(client) == {}
        said = "".join(path.read_bytes()[size:].decode() for path, size in node1_logs.items())
        assert "Traceback" not in said and "Dask workers ended" not in said, said  # not started again as it stopped
        assert len(node1_group) > 2 and not gone_within(node1_group, 10)  # the agent, its Dask workers, fork server
        deadline = time.monotonic() + 30
        while scheduler_workers(client) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not scheduler_workers(client)  # the agents took their Dask workers with them


def _process_group(pgid: int) -> list:
    """The live processes of process group `pgid`."""
    import psutil

    def group_of(process) -> int | None:
        try:
            return os.getpgid(process.pid)
        except ProcessLookupError:
            return None
    return [process for process in psutil.process_iter() if group_of(process) == pgid]


def _rates_are_measured_by_node_0s_agent(hosts, overrides, registered, agents, tls_files, tmp_path):
    """A driver (python -m pipeline) with a policy that needs rates (fleet_g): node 0's agent measures them
    on its host (its children, its devices), not the driver: the run's recorded results (state/run.json,
    written once the rates are in, before training) name the agent's process for every rate, and only
    node 0's agent logs measuring. The driver is then killed: training is not what this checks (a
    fleet_g flotilla here can stall at node 1's hub, whoever measured the rates). A rank failing at the
    agent is an error here naming the model and the agent's host."""
    import json

    import psutil

    from pipeline.orchestration.agent import agent_rates
    from pipeline.training.group import GroupSpec
    from tests.conftest import member
    from pipeline.training.rates import Measurement, measure_rate_table

    folder = tmp_path / "fleet"
    with open(tmp_path / "fleet.log", "w") as log:
        driver = subprocess.Popen(hosts.command("driver", [
            sys.executable, "-m", "pipeline", *overrides, "scheduler=fleet_g",
            f"rates.cache={tmp_path / 'rate_cache.json'}", f"hydra.run.dir={folder}"]),
            stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while not (folder / "state" / "run.json").is_file():
                assert time.monotonic() < deadline and driver.poll() is None, (tmp_path / "fleet.log").read_text()
                time.sleep(0.2)
        finally:
            driver.kill()
            driver.wait()
    results = json.loads((folder / "state" / "run.json").read_text())["results"]
    measured_by = results["rates_measured_by"]
    assert set(measured_by) == {"A", "B", "C"} and all(set(by) == {"1", "2"} for by in measured_by.values())
    assert {by["pid"] for rates in measured_by.values() for by in rates.values()} == {agents[0].pid}, measured_by
    saved = json.loads((folder / "rates.json").read_text())
    starts = {name: entry["start_s"] for name, entry in saved.items()}
    saved = {name: entry["images_per_s"] for name, entry in saved.items()}
    assert set(saved) == {"A", "B", "C"} and all(rate > 0 for rates in saved.values() for rate in rates.values())
    # ...and they are the agent's measurements, as its cache entries hold them (C has A's shape: A's entry),
    # each group's start that of its most slots
    entries = [entry for entry in json.loads((tmp_path / "rate_cache.json").read_text())
               if {by["pid"] for by in entry["measured_by"].values()} == {agents[0].pid}]
    assert {rate for rates in saved.values() for rate in rates.values()} == \
        {rate for entry in entries for rate in entry["images_per_s"].values()}
    assert set(starts.values()) == {entry["start_s"]["2"] for entry in entries}
    # What the killed driver had started at the agents goes with it.
    started = _children_named(agents, ("hub", "trainer", "rates"))
    _, alive = psutil.wait_procs(started, timeout=10)
    assert not alive, [(p.pid, p.name()) for p in alive]
    logs = [(tmp_path / f"agent{node}.log").read_text() for node in (0, 1)]
    # C has A's shape: its rates are A's cache entry, which names the agent too.
    assert sorted(re.findall(r"node 0: measuring (\w+) on 1, 2 slot\(s\)", logs[0])) == ["A", "B"], logs[0]
    assert "measuring" not in logs[1]
    resnet11 = member("resnet11", depth=11)  # no such depth
    with agent_rates(registered, AGENT_KEY.encode(), Link(30, tls_files)) as where:
        how = Measurement(num_classes=4, image_sizes={"main": 32}, batch_size=16, device_kind="cpu", devices=["cpu"],
                          steps=1, warmup=0, threads=1, where=where)
        with pytest.raises(RuntimeError, match=rf"(?s)node 0's agent at {registered[0]['address']} \(host .+, pid "
                                               rf"{agents[0].pid}\) failed: measuring resnet11 \(.*\) on 1 slot.*"
                                               "resnet depth must be one of"):
            measure_rate_table([GroupSpec("resnet11", (resnet11,))], 1, how, tmp_path / "bad_cache.json")


def _children_named(agents, names: tuple[str, ...]) -> list:
    """The agents' children (and theirs) whose process names are among `names` (lifetime.child_started)."""
    import psutil

    found = []
    for agent in agents:
        for child in psutil.Process(agent.pid).children(recursive=True):
            try:
                if child.name() in names:
                    found.append(child)
            except psutil.NoSuchProcess:  # it ended between the listing and the read (seen in CI)
                pass
    return found


def stacks(processes: list) -> dict:
    """Every thread's stack in each of `processes` (pids or psutil processes), by py-spy: what a check that
    failed on a process still running shows about it."""
    found = {}
    for process in processes:
        pid = getattr(process, "pid", process)
        try:
            dumped = subprocess.run([Path(sys.executable).with_name("py-spy"), "dump", "--pid", str(pid)],
                                    capture_output=True, text=True, timeout=30)
            found[pid] = dumped.stdout + dumped.stderr
        except (OSError, subprocess.TimeoutExpired) as err:
            found[pid] = f"no stack: {err}"
    return found


def _a_driver_killed_outright_leaves_nothing_running_at_the_agents(hosts, overrides, agents, tmp_path):
    """While a flotilla trains (its first epoch validated: the hubs' process group spans the hosts), every
    socket listening on an agent's host is on its address or loopback (not on every interface: the agents'
    Dask workers' HTTP servers and rank 0's store did that), and none at the driver. Then SIGKILL to the
    driver: each agent sees its link to the driver break and closes the flotilla's hubs and trainers there
    (within 20 s: a hub in the middle of a split gets timeouts.drain_s=5 to finish it, 60 s by default,
    which failed this check in CI; one failure with 20 s was a hub the scenario before's killed driver had
    started, still waiting for its peer, as likely was an earlier one with 10 s: NodeProcesses now stops such
    a hub at once); the agents serve on."""
    import psutil

    log_path = tmp_path / "killed.log"
    with open(log_path, "w") as log:
        driver = subprocess.Popen(hosts.command("driver", [
            sys.executable, "-m", "pipeline", *overrides, "trainer.epochs=50", "scheduler.patience=0",
            "timeouts.drain_s=5", f"hydra.run.dir={tmp_path / 'killed'}"]), stdout=log, stderr=subprocess.STDOUT)
    def flotilla() -> list:
        return _children_named(agents, ("hub", "trainer"))

    try:
        deadline = time.monotonic() + 180
        while len(flotilla()) < 2 + 4 or "val accuracy" not in log_path.read_text():  # a hub per node, 4 trainers
            assert time.monotonic() < deadline and driver.poll() is None, log_path.read_text()
            time.sleep(0.2)
        running = flotilla()
        listened = [listening(agent.pid) for agent in agents]
        at_driver = listening(driver.pid)
    finally:
        driver.kill()
        driver.wait()
    for node, found in enumerate(listened):
        own = hosts.addresses[f"node{node}"]
        assert own in found <= {own, LOOPBACK}, found
    assert at_driver == set()
    _, alive = psutil.wait_procs(running, timeout=20)
    if alive:  # printed whole (pytest cuts an assertion's message short): where each process is, and what it said
        print(stacks([agent.pid for agent in agents] + alive), *[(tmp_path / f"agent{n}.log").read_text()[-3000:]
                                                                for n in (0, 1)], sep="\n")
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert all(agent.poll() is None for agent in agents)
    # ...and then removes the run's cache there.
    stores = lambda: [name for name in os.listdir("/dev/shm")
                      if name.startswith(tuple(cache_prefix(agent.pid) for agent in agents))]
    deadline = time.monotonic() + 10
    while stores() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not stores()


def _a_lost_host_fails_its_models_and_the_run_goes_on_without_it(hosts, overrides, agents, client, tmp_path,
                                                                  restart, env):
    """Node 1's host is lost mid-run (its agent and everything under it SIGKILLed, as a host powered off):
    the driver says so in one line naming the node and its agent's address; the model training there counts
    a failure and resumes from its last checkpoint once a slot is free; the others train on; the run finishes
    with every model's epochs counted once. The lost host left its rings and semaphores in /dev/shm: its
    agent, started again, removes them, and the run takes node 1 back (its model resumes there if node 1 is
    back before a slot of node 0 frees). That agent takes the lost one's place in `agents` as it starts (the
    test's teardown stops it whatever fails after)."""
    from pipeline.orchestration.agent import registered_agents

    folder, log_path = tmp_path / "lost", tmp_path / "lost.log"
    agent1, lost = registered_agents(client)[1], agents[1]
    before = set(os.listdir("/dev/shm"))
    with open(log_path, "w") as log:  # baseline: a flotilla per model, on one slot of one node
        driver = subprocess.Popen(hosts.command("driver", [
            sys.executable, "-m", "pipeline", *overrides, "scheduler=baseline", "trainer.epochs=8", *PACED,
            f"rates.cache={tmp_path / 'rate_cache.json'}", f"hydra.run.dir={folder}"]),
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "400"})  # a line is a line
    first_epochs = lambda: re.findall(r"val accuracy \w+ \S+ \(epoch 1\)", log_path.read_text())
    try:
        deadline = time.monotonic() + 180
        while len(first_epochs()) < 3:  # every model checkpointed after its first epoch, on its own slot
            assert time.monotonic() < deadline and driver.poll() is None, log_path.read_text()
            time.sleep(0.1)
        os.killpg(lost.pid, signal.SIGKILL)
        lost.wait()
        while "node 1 lost" not in log_path.read_text():
            assert time.monotonic() < deadline and driver.poll() is None, log_path.read_text()
            time.sleep(0.1)
        # Started again while the run goes on (here, where the hosts share /dev/shm, before the driver's
        # own sweep at its end could remove the dead agent's rings).
        left = set(os.listdir("/dev/shm")) - before
        rings = {name for name in left if name.startswith(f"ensemble-{lost.pid}-")}
        assert any("-cache-" not in name for name in rings), left  # a ring of its flotilla, its cache too
        assert {name for name in left if name.startswith("sem.mp-")}, left  # the lost host's semaphores
        folders = {name for name in os.listdir(tempfile.gettempdir())
                   if name.startswith(f"ensemble-rendezvous-{lost.pid}-")}  # its flotilla's
        assert folders
        mp_folders = {Path(mark).parent.name for mark in glob.glob(  # the agent's own, its fork server's socket
            os.path.join(glob.escape(tempfile.gettempdir()), "pymp-*", f"ensemble-owner-{lost.pid}"))}
        assert mp_folders
        with open(tmp_path / "agent1-again.log", "w") as log:
            agents[1] = agent = subprocess.Popen(restart, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                 start_new_session=True)
        while registered_agents(client).get(1, {}).get("pid") != agent.pid:
            assert time.monotonic() < deadline and agent.poll() is None, (tmp_path / "agent1-again.log").read_text()
            time.sleep(0.2)
        said = (tmp_path / "agent1-again.log").read_text()
        removed = set(re.search(r"node 1: removed what dead processes left in /dev/shm and \S+: (.*)",
                                said)[1].split(", "))
        assert rings | folders | mp_folders <= removed and any(name.startswith("sem.mp-") for name in removed), said
        assert not removed & set(os.listdir("/dev/shm") + os.listdir(tempfile.gettempdir()))
        while "node 1 is back" not in log_path.read_text():  # the run, 7 epochs from its end, takes it back
            assert time.monotonic() < deadline and driver.poll() is None, log_path.read_text()
            time.sleep(0.1)
        assert driver.wait(240) == 0, log_path.read_text()
    finally:
        driver.kill()
    address = registered_agents(client)[1]["address"]
    lines = log_path.read_text().splitlines()
    assert f"node 1 is back: its agent at {address} (pid {agent.pid}) takes flotillas again" in lines
    # its agent killed, the driver's read of the link ends (FIN), or is reset where unread bytes were left (RST)
    (resumed_on,) = _models_of_the_lost_node_resumed(log_path, folder, agent1["address"],
                                                     ("EOFError", "ConnectionResetError"), 8)
    if resumed_on == 1:  # placed there after it was back
        formed = next(i for i, line in enumerate(lines) if re.match(r"flotilla 3 formed", line))
        assert lines.index(f"node 1 is back: its agent at {address} (pid {agent.pid}) takes flotillas again") < formed


def _a_host_cut_off_is_lost_after_timeouts_host_s(hosts, overrides, agents, client, tmp_path):
    """Node 1's host is cut off mid-run (its network down, inside its namespace: packets dropped, nobody
    told). The driver's calls to its agent go unanswered: after timeouts.host_s the driver says in one line
    that node 1 was lost, and the run goes on as for a killed host. The agent, whose driver fell silent,
    closes that flotilla's processes and shared memory by itself (its hub gets timeouts.drain_s), and the
    connections serving the driver break (--host-s), their threads ending. The host comes back: its Dask
    workers, removed meanwhile, close; the agent starts them again and registers anew, and the run takes
    node 1 back by itself."""
    from pipeline.orchestration.agent import registered_agents

    folder, log_path = tmp_path / "cut", tmp_path / "cut.log"
    agent1, pid = registered_agents(client)[1], agents[1].pid
    said_before = (tmp_path / "agent1-again.log").read_text()
    with open(log_path, "w") as log:
        driver = subprocess.Popen(hosts.command("driver", [
            sys.executable, "-m", "pipeline", *overrides, "scheduler=baseline", "trainer.epochs=12", *PACED,
            "timeouts.host_s=4", "timeouts.drain_s=5", f"rates.cache={tmp_path / 'rate_cache.json'}",
            f"hydra.run.dir={folder}"]),
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "400"})
    first_epochs = lambda: re.findall(r"val accuracy \w+ \S+ \(epoch 1\)", log_path.read_text())
    ours = lambda: [name for name in os.listdir("/dev/shm") if name.startswith(f"ensemble-{pid}-")]
    try:
        deadline = time.monotonic() + 180
        while len(first_epochs()) < 3:
            assert time.monotonic() < deadline and driver.poll() is None, log_path.read_text()
            time.sleep(0.1)
        assert ours()  # node 1's flotilla's ring and its host's cache
        serving = lambda: connected(pid, hosts.addresses["driver"])  # the driver's links to the agent
        assert serving()
        hosts.cut("node1")
        try:
            while "node 1 lost" not in log_path.read_text():
                assert time.monotonic() < deadline and driver.poll() is None, log_path.read_text()
                time.sleep(0.1)
            while ours() or serving():  # still cut off: the agent acts on its driver's silence (the run may be
                assert time.monotonic() < deadline, (ours(), serving())  # over), its --host-s=4 later at most
                time.sleep(0.1)
        finally:
            hosts.heal("node1")
        while "node 1 is back" not in log_path.read_text():  # the run, several epochs from its end, takes it back
            assert time.monotonic() < deadline and driver.poll() is None, (log_path.read_text(),
                                                                           (tmp_path / "agent1-again.log").read_text())
            time.sleep(0.1)
        assert driver.wait(240) == 0, log_path.read_text()
    finally:
        driver.kill()
    said = (tmp_path / "agent1-again.log").read_text()[len(said_before):]
    assert "node 1: the driver is gone: closing its flotilla" in said, said
    assert re.search(r"node 1: its Dask workers ended \(exit code .*\): starting them again", said), said
    back = registered_agents(client)[1]  # the same agent, with new workers
    assert back["address"] == agent1["address"] and back["workers_pid"] != agent1["workers_pid"], back
    assert f"node 1 is back: its agent at {back['address']} (pid {pid}) takes flotillas again" in log_path.read_text()
    _models_of_the_lost_node_resumed(log_path, folder, agent1["address"], ("silent for timeouts.host_s=4 s",), 12)


def _a_run_started_while_a_host_is_cut_off_trains_on_the_others(hosts, overrides, client, tmp_path):
    """Node 1's host is cut off before the run starts, so the Dask scheduler still lists its workers while
    the first flotillas form: those on node 0 set up their hubs without waiting on node 1's workers; node 1
    is lost once connecting to its agent has waited timeouts.host_s, and the run trains every model on node
    0. The host back, its agent starts its workers again and registers anew."""
    from pipeline.orchestration.agent import registered_agents

    folder, log_path = tmp_path / "cut-first", tmp_path / "cut-first.log"
    before = registered_agents(client)[1]
    hosts.cut("node1")
    try:
        with open(log_path, "w") as log:
            driver = subprocess.run(hosts.command("driver", [
                sys.executable, "-m", "pipeline", *overrides, "scheduler=baseline", "trainer.epochs=2",
                "timeouts.host_s=6", "timeouts.drain_s=5", f"rates.cache={tmp_path / 'rate_cache.json'}",
                f"hydra.run.dir={folder}"]), stdout=log, stderr=subprocess.STDOUT, timeout=240,
                env={**os.environ, "COLUMNS": "400"})
    finally:
        hosts.heal("node1")
    said = log_path.read_text()
    assert driver.returncode == 0, said
    (line,) = [line for line in said.splitlines() if line.startswith("node 1 lost: ")]
    assert f"agent at {before['address']} does not answer (timed out" in line, line
    models = json.loads((folder / "results.json").read_text())["models"]
    assert {model["name"]: model["epochs"] for model in models} == dict.fromkeys("ABC", 2)  # each once
    deadline = time.monotonic() + 120
    while registered_agents(client)[1]["workers_pid"] == before["workers_pid"]:
        assert time.monotonic() < deadline, "node 1's agent did not start its Dask workers again"
        time.sleep(0.2)


def _a_run_no_slot_left_can_take_stops_with_exit_5_and_resumes_once_the_host_is_back(
        hosts, overrides, agents, client, tmp_path, restart, env):
    """scheduler=shared: every model at once, on both nodes (B asks for 2 slots, a node's). Node 1's agent
    is stopped after the first epoch, as systemd stops it (SIGTERM to its whole group): it ends at once
    (its hub and trainers ignore SIGTERM: it kills them; it hung in multiprocessing's exit before),
    exit 0, taking the flotilla's rings with it; the driver takes node 1 for lost. The 2 slots left cannot
    take the 4 the models ask for, so the run stops in order, exit code 5, with one line saying how to
    resume it. Node 1's agent started again, that command (on the driver's host) finishes the run, every
    model's epochs counted once. That agent takes the stopped one's place in `agents` as it starts."""
    import shlex

    from pipeline.orchestration.agent import registered_agents

    folder, log_path = tmp_path / "stranded", tmp_path / "stranded.log"
    with open(log_path, "w") as log:
        driver = subprocess.Popen(hosts.command("driver", [
            sys.executable, "-m", "pipeline", *overrides, "scheduler=shared", "trainer.epochs=3", *PACED,
            f"hydra.run.dir={folder}"]), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "400"})
    try:
        deadline = time.monotonic() + 180
        while "(epoch 1)" not in log_path.read_text():  # every model's first epoch: one flotilla, one line
            assert time.monotonic() < deadline and driver.poll() is None, log_path.read_text()
            time.sleep(0.1)
        flotilla = _children_named(agents[1:], ("hub", "trainer"))
        said_before = (tmp_path / "agent1-again.log").read_text()
        os.killpg(agents[1].pid, signal.SIGTERM)
        assert agents[1].wait(30) == 0
        said = (tmp_path / "agent1-again.log").read_text()[len(said_before):]
        assert "node 1: stopping: closed the processes of 1 flotilla(s) here" in said and "Traceback" not in said
        assert flotilla and not gone_within(flotilla, 5), flotilla
        assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"ensemble-{agents[1].pid}-")]
        assert driver.wait(120) == 5, log_path.read_text()
    finally:
        driver.kill()
    said = log_path.read_text()
    assert "node 1 lost: the agent at" in said, said
    (line,) = [line for line in said.splitlines() if "to resume: python -m pipeline " in line]
    assert line.startswith("stopped (") and line.endswith(f"resume={folder}"), line
    interrupted = json.loads((folder / "results.json").read_text())["interrupted"]
    assert interrupted["lost_nodes"] == [1] and "no slot left can take A, B, C" in interrupted["cause"], interrupted
    with open(tmp_path / "agent1-stranded.log", "w") as log:
        agents[1] = agent = subprocess.Popen(restart, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True)
    while registered_agents(client).get(1, {}).get("pid") != agent.pid:
        assert time.monotonic() < deadline and agent.poll() is None, (tmp_path / "agent1-stranded.log").read_text()
        time.sleep(0.2)
    command = shlex.split(line.split("to resume: ", 1)[1])
    resumed = subprocess.run(hosts.command("driver", [sys.executable, *command[1:],
                                                      f"hydra.run.dir={tmp_path / 'resumed'}"]),
                             capture_output=True, text=True, timeout=240, env={**os.environ, "COLUMNS": "400"})
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    models = {m["name"]: m for m in json.loads((folder / "results.json").read_text())["models"]}
    assert {name: model["epochs"] for name, model in models.items()} == dict.fromkeys("ABC", 3)  # each once
    on_1 = {name for name, model in models.items() if model["failures"]}
    assert on_1 and all("node 1 lost" in models[name]["failures"][0] for name in on_1), models


def _models_of_the_lost_node_resumed(log_path, folder, address, whys: tuple, epochs) -> list[int]:
    """What the run in `folder` said and recorded when node 1 (its agent at `address`) was lost after every
    model's first epoch: one line naming node, address and one of `whys`; the models there failed once, stopped, and
    resumed from their checkpoints; every model's `epochs` counted once. Returns the nodes they resumed on."""
    out = " ".join(log_path.read_text().split())  # the console wraps at 80 columns, where the digits put it
    (line,) = re.findall(r"node 1 lost: .*? does not answer.*?resume from their last checkpoints", out)
    assert address in line and any(why in line for why in whys), line
    results = json.loads((folder / "results.json").read_text())
    placed = [(d["group"], int(re.search(r"node=(\d+)", d["slots"])[1]))
              for d in results["scheduler"]["decisions"] if d["decision"] == "AssignSlots"]
    lost = sorted({model for model, node in placed[:3] if node == 1})  # the first plan: a slot each
    assert lost and sorted(model for model, _ in placed[3:]) == lost, placed
    stops = [d for d in results["scheduler"]["decisions"] if d["decision"] == "Stop" and d["reason"] == "node 1 lost"]
    assert sorted(d["group"] for d in stops) == lost
    models = {model["name"]: model for model in results["models"]}
    assert {name: model["epochs"] for name, model in models.items()} == dict.fromkeys("ABC", epochs)  # each once
    assert {name: len(model["failures"]) for name, model in models.items()} == {m: int(m in lost) for m in "ABC"}
    assert all("node 1 lost" in models[name]["failures"][0] for name in lost)
    resumed = [stint["start_epoch"] for name in lost for stint in models[name]["flotillas"][1:]]
    assert len(resumed) == len(lost) and all(start >= 1 for start in resumed)  # from its checkpoint, not anew
    return [node for _, node in placed[3:]]


def test_node_agents_numbered_otherwise_than_cluster_nodes_is_a_clear_error(tmp_path):
    from dask.distributed import Client, LocalCluster

    from pipeline.orchestration.agent import AGENTS
    from pipeline.run import ConfigError, _node_agents

    with LocalCluster(n_workers=0, dashboard_address=":0") as cluster, Client(cluster) as client:
        for node in (0, 2):  # as if agents were started with --node 0 and --node 2
            client.set_metadata([AGENTS, str(node)], {"address": "127.0.0.1:1", "pid": 1, "gpus": 0,
                                                      "gpu_memory": None})
        cfg = compose_config(["+ensemble=caltech256", f"cluster.address={cluster.scheduler_address}",
                              "cluster.nodes=2"])
        with pytest.raises(ConfigError, match=r"cluster.nodes=2 but the scheduler at .* has node agents \[0, 2\]"):
            _node_agents(cfg, None)


@pytest.mark.slow
def test_a_lost_node_loses_its_dask_workers_and_returns_with_a_new_agent_that_answers():
    """NodeAgents, the driver's view of the agents: a lost node's Dask workers are removed from the scheduler
    (the others stay); the node is back only once another agent than the lost one is registered for it and
    answers; the flotillas then reach it there."""
    import socket

    from dask.distributed import Client, LocalCluster, Worker

    from pipeline.orchestration.agent import AGENTS, NodeAgents

    async def worker_of(address, node):
        return await Worker(address, nthreads=1, resources={f"node-{node}": 1})

    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client, \
            socket.create_server((LOOPBACK, 0)) as listening, socket.create_server((LOOPBACK, 0)) as closed:
        workers = [client.sync(worker_of, cluster.scheduler_address, node) for node in (0, 1)]
        by_node = {node: [workers[node].address] for node in (0, 1)}
        lost = {"address": "127.0.0.1:1", "pid": 1}
        agents = {0: {"address": "127.0.0.1:2", "pid": 2}, 1: lost}
        hosts = NodeAgents(client, agents)
        hosts.lose(1)
        assert sorted(scheduler_workers(client)) == by_node[0] and len(by_node[1]) == 1
        client.set_metadata([AGENTS, "1"], lost)
        assert hosts.returned(1) is None  # the lost agent itself
        silent = {"address": f"{LOOPBACK}:{closed.getsockname()[1]}", "pid": 3}
        closed.close()
        client.set_metadata([AGENTS, "1"], silent)
        assert hosts.returned(1) is None and agents[1] == lost  # registered, but it does not answer
        again = {"address": f"{LOOPBACK}:{listening.getsockname()[1]}", "pid": 4}
        client.set_metadata([AGENTS, "1"], again)
        assert hosts.returned(1) == again and agents[1] == again
        for worker in workers:
            client.sync(worker.close)


NOT_OURS = r"--host 198.51.100.77 is not an address of this host \(it has [\d., ]*127\.0\.0\.1"


@pytest.mark.parametrize("options, message", [
    (["--host", "198.51.100.77"], NOT_OURS),
    (["--host", "198.51.100.77", "--interface", "lo"], NOT_OURS),  # a named interface does not excuse the address
    (["--interface", "nosuch0"], "--interface nosuch0: this host has no such interface; it has .*lo"),
])
def test_an_agent_given_an_address_or_interface_not_its_own_says_so_in_one_line(options, message, monkeypatch,
                                                                                 capsys):
    from pipeline.node import main

    monkeypatch.setenv(AGENT_KEY_ENV, AGENT_KEY)
    with pytest.raises(SystemExit) as exit_:
        main(["tcp://127.0.0.1:1", "--node", "0", *options])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and re.search(message, err), err


def test_an_agent_reaching_its_scheduler_on_loopback_takes_loopback():
    """Without --host, the address this host reaches the scheduler from, and that address's interface (or the
    one named). Only loopback here: test_node_agents_on_hosts_of_their_own checks hosts' own addresses."""
    import psutil

    from pipeline.node import address_towards, interface_for

    assert address_towards("tls://127.0.0.1:8786") == LOOPBACK
    assert interface_for(LOOPBACK, None) == "lo"
    other = next((name for name in psutil.net_if_addrs() if name != "lo"), "lo")  # "lo": a host with no other
    assert interface_for(LOOPBACK, other) == other


@contextmanager
def _agent_serving(served: type, tls_files=None):
    """A test agent (a node agent's manager protocol, _Agent) serving `served` on loopback, started: its
    class, which a driver connects with, and the agent; it is shut down after the block."""
    from pipeline.orchestration.agent import _Agent, _proxy_type

    class Agent(_Agent):
        pass

    Agent.register(served.__name__, served, proxytype=_proxy_type(served))
    agent = Agent((LOOPBACK, 0), AGENT_KEY.encode(), Link(None, tls_files))
    agent.start()
    try:
        yield Agent, agent
    finally:
        agent.shutdown()


class Refuses:
    """Served by a test agent: its method fails as a link of the agent's own does (marked as the agent's
    link failure, which must not read as the driver's once sent back)."""

    def call(self) -> None:
        import socket

        with socket.create_server((LOOPBACK, 0)) as closed:  # a port nothing listens on once closed
            port = closed.getsockname()[1]
        Link(2, None).connect((LOOPBACK, port))


def test_a_link_to_an_agent_breaks_on_silence_and_only_a_broken_link_is_a_lost_host():
    """The driver's links to an agent carry keepalive probes and a user timeout of timeouts.host_s (a host
    cut off is lost after that long: test_node_agents_on_hosts_of_their_own cuts one). An OSError the
    agent's method raised comes back as itself; the link broken (the agent gone) is HostLost, and so is
    every call after it, without trying the link again."""
    import socket

    from pipeline.orchestration.link import broke_the_link
    from pipeline.orchestration.agent import HostLost

    with _agent_serving(Refuses) as (Agent, served):
        driver = Agent(served.address, AGENT_KEY.encode(), Link(8, None))
        driver.connect()
        remote = driver.Refuses()
        with pytest.raises(ConnectionRefusedError) as refused:
            remote.call()
        assert hasattr(refused.value, "broke_the_link")  # the agent's link failure, marked there...
        assert not broke_the_link(refused.value)  # ...is not the driver's
        with socket.socket(fileno=os.dup(remote._tls.connection.fileno())) as link:
            assert link.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert link.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 8000
            assert link.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 2  # then 3 probes 2 s apart
            assert link.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1  # no call waits on a delayed ACK
    host, port = served.address
    for _ in range(2):
        with pytest.raises(HostLost, match=rf"the agent at {host}:{port} does not answer \((EOFError|Connection)"):
            remote.call()


class Stopping:
    """Served by a test agent: refuses as a stopping agent refuses to start a child."""

    def call(self) -> None:
        from pipeline.runtime.lifetime import ChildrenStopped

        raise ChildrenStopped("hub-0-node1: this process is stopping; it starts no child")


def test_a_call_an_agent_refuses_as_it_stops_is_a_lost_host():
    """An agent that stops refuses to start what a driver asks for (lifetime.stop_children) an instant
    before its links break: the driver takes that refusal as the host lost, as it takes the break (its
    models resume elsewhere), not as a failure of the run (exit 1), and every call after it too."""
    from pipeline.orchestration.agent import HostLost

    with _agent_serving(Stopping) as (Agent, served):
        driver = Agent(served.address, AGENT_KEY.encode(), Link(8, None))
        driver.connect()
        remote = driver.Stopping()
        host, port = served.address
        for _ in range(2):
            with pytest.raises(HostLost, match=rf"^the agent at {host}:{port} does not answer \(it is "
                                               r"stopping\)$"):
                remote.call()


class Echoes:
    """Served by a test agent: gives back what it is given."""

    def echo(self, value):
        return value


@contextmanager
def _recording_relay(upstream: tuple[str, int]):
    """A TCP relay on loopback to `upstream`: (its address, the bytes that have crossed it either way)."""
    import socket
    import threading

    seen, links = bytearray(), []
    server = socket.create_server((LOOPBACK, 0))

    def pump(source, sink):
        try:
            while chunk := source.recv(1 << 16):
                seen.extend(chunk)
                sink.sendall(chunk)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the relay closed

    def relay():
        while True:
            try:
                near, _ = server.accept()
            except OSError:
                return  # shut down
            far = socket.create_connection(upstream)
            links.extend((near, far))
            for source, sink in ((near, far), (far, near)):
                threading.Thread(target=pump, args=(source, sink), daemon=True).start()

    threading.Thread(target=relay, daemon=True).start()
    try:
        yield server.getsockname(), seen
    finally:
        server.shutdown(socket.SHUT_RDWR)  # wakes the accept
        server.close()
        for link in links:
            link.close()


@pytest.mark.parametrize("encrypted", [True, False], ids=["tls", "plain"])
def test_the_driver_agent_link_is_tls_with_the_clusters_certificates(encrypted, tls, tmp_path):
    """With the cluster's Dask certificates, what the driver and an agent say crosses the network encrypted
    (without them it crosses in clear: the check can fail); a message of many TLS records arrives whole; and a
    driver whose certificate another CA signed is refused in one line that names both ends' settings."""
    from pipeline.orchestration.agent import _connect
    from tests.conftest import throwaway_tls

    files = tls[1] if encrypted else None
    with _agent_serving(Echoes, files) as (Agent, served):
        with _recording_relay(served.address) as ((host, port), seen):
            manager = Agent((host, port), AGENT_KEY.encode(), Link(8, files))
            manager.connect()
            said = b"what a flotilla says " * 5000  # 105 kB: 7 TLS records at least
            assert manager.Echoes().echo(said) == said
            assert (said[:42] in seen) is not encrypted
        if encrypted:
            host, port = served.address
            foreign = throwaway_tls(tmp_path)[1]
            for driver in (foreign, replace(foreign, ca_file=files.ca_file)):  # the driver refuses; the agent does
                with pytest.raises(UserError, match=rf"node 0's agent at {host}:{port} and this driver do not accept "
                                                    r"each other's TLS certificate \(.+\): .*cluster.tls.*--tls-\*"):
                    _connect(0, {"address": f"{host}:{port}"}, AGENT_KEY.encode(), Link(8, driver))
