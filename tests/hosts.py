"""Test hosts on this machine: network namespaces on a bridge, each its own loopback and its own address.

The rules: everything made here carries the prefix `PREFIX`; the addresses are in TEST-NET-2
(198.51.100.0/24), checked free first; this machine's own interfaces, addresses, routes, firewall and /etc
files are never touched (the bridge, made here, is this machine's end, at .1); all of it is removed however
a test ends, and what a crashed earlier run left (its prefix) before a new one starts: so one test session
at a time per machine.
Where namespaces cannot be made (not root, no `ip`), the test is skipped saying why.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

PREFIX = "enst"  # namespaces enst-<host>, veths enst-v<i> (eth0 inside), bridge enst-br
BRIDGE = f"{PREFIX}-br"
SUBNET = "198.51.100"  # TEST-NET-2: routed nowhere
GONE_S = 30  # what killed processes and removed namespaces get to be gone
LISTEN, ESTABLISHED = "0A", "01"  # TCP sockets' states in /proc/net/tcp


def _ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _remove_ours() -> None:
    """What this fixture made (also what a crashed earlier run left): its namespaces (with whatever was
    left running inside), its veths and its bridge, each waited for until gone, so that the names are
    free again."""
    namespaces = [line.split()[0] for line in _ip("netns", "list").splitlines()
                  if line.startswith(f"{PREFIX}-")]
    deadline = time.monotonic() + GONE_S
    for namespace in namespaces:
        while pids := _ip("netns", "pids", namespace, check=False).split():
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {pids} in test host {namespace} outlived SIGKILL for {GONE_S} s")
            time.sleep(0.05)
        _ip("netns", "del", namespace, check=False)
    # A namespace outlives its name while the kernel holds sockets of it (closing TCP connections): its
    # veth with it. Deleting this end deletes the pair.
    while links := [name.split("@")[0] for _, name, _ in (line.split(": ", 2) for line in
                    _ip("-o", "link", "show").splitlines()) if name.startswith(f"{PREFIX}-")]:
        for link in links:
            _ip("link", "del", link, check=False)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the test hosts' links {links} outlived {GONE_S} s of deleting them")
        time.sleep(0.05)


class Hosts:
    """Hosts named `names`, host i at SUBNET.(i + 2). `command(host, argv)` runs argv there (the same pid:
    `ip netns exec` execs it)."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.addresses = {name: f"{SUBNET}.{i + 2}" for i, name in enumerate(names)}

    def namespace(self, host: str) -> str:
        return f"{PREFIX}-{host}"

    def command(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def cut(self, host: str) -> None:
        """Cut `host` off the network, inside its own namespace: its packets are dropped, nobody is told."""
        _ip("-n", self.namespace(host), "link", "set", "eth0", "down")

    def heal(self, host: str) -> None:
        _ip("-n", self.namespace(host), "link", "set", "eth0", "up")

    def __enter__(self) -> Hosts:
        if os.geteuid() != 0 or not shutil.which("ip"):
            pytest.skip("test hosts are network namespaces: they need root and iproute2's ip")
        _remove_ours()
        if f" {SUBNET}." in _ip("-4", "addr") or f"{SUBNET}." in _ip("-4", "route"):
            pytest.skip(f"{SUBNET}.0/24 is in use on this machine (ip -4 addr, ip -4 route): no test hosts there")
        route = _ip("-4", "route", "show", "default")
        try:
            _ip("link", "add", BRIDGE, "type", "bridge")
        except RuntimeError as err:
            pytest.skip(f"cannot make test hosts here ({err})")
        try:
            _ip("addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
            _ip("link", "set", BRIDGE, "up")
            for i, name in enumerate(self.names):
                namespace, veth = self.namespace(name), f"{PREFIX}-v{i}"
                _ip("netns", "add", namespace)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
                _ip("link", "set", veth, "master", BRIDGE, "up")
                _ip("-n", namespace, "addr", "add", f"{self.addresses[name]}/24", "dev", "eth0")
                _ip("-n", namespace, "link", "set", "eth0", "up")
                _ip("-n", namespace, "link", "set", "lo", "up")
            assert _ip("-4", "route", "show", "default") == route, "this machine's default route changed"
        except BaseException:
            _remove_ours()
            raise
        return self

    def __exit__(self, *exc) -> None:
        _remove_ours()


@contextmanager
def dask_scheduler(hosts: Hosts, folder: Path, tls_files=None) -> Iterator[str]:
    """A Dask scheduler on the host "scheduler", its address's port chosen there (TLS only with `tls_files`,
    a pipeline TlsFiles): its address, while it runs."""
    address, file = hosts.addresses["scheduler"], folder / "scheduler.json"
    file.unlink(missing_ok=True)
    tls = ["--protocol", "tls", "--tls-ca-file", tls_files.ca_file, "--tls-cert", tls_files.cert, "--tls-key",
           tls_files.key] if tls_files else []
    process = subprocess.Popen(hosts.command("scheduler", [
        sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", address, "--port", "0",
        "--dashboard-address", f"{address}:0", "--scheduler-file", str(file), *tls]),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not file.is_file() or not file.read_text().strip():
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("the Dask scheduler on the test host did not start")
            time.sleep(0.1)
        yield json.loads(file.read_text())["address"]
    finally:
        process.terminate()
        process.wait(30)


def _tcp_sockets(pid: int) -> Iterator[tuple[str, str, str]]:
    """(local address, remote address, state) of every TCP socket in the network namespace of process
    `pid` (its /proc/<pid>/net)."""
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{table}") as rows:
            next(rows)
            for row in rows:
                local, remote, state = row.split()[1:4]
                yield _address(local, family), _address(remote, family), state


def _address(hex_address: str, family: int) -> str:
    packed = bytes.fromhex(hex_address.split(":")[0])
    # the kernel writes each 32-bit word of the address in host (little-endian) order
    return socket.inet_ntop(family, b"".join(packed[i:i + 4][::-1] for i in range(0, len(packed), 4)))


def listening(pid: int) -> set[str]:
    """The addresses TCP sockets listen on in the network namespace of process `pid`, "0.0.0.0" or "::" for
    every address."""
    return {local for local, _, state in _tcp_sockets(pid) if state == LISTEN}


def connected(pid: int, address: str) -> int:
    """How many TCP connections to `address` are open in the network namespace of process `pid`."""
    return sum(remote == address and state == ESTABLISHED for _, remote, state in _tcp_sockets(pid))
