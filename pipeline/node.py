"""`python -m pipeline.node <scheduler> --node <i> --key-file agent.key`: serve this host as one node
of a multi-host run: its Dask workers, hubs and trainers (pipeline/orchestration/agent.py)."""
from __future__ import annotations

import argparse
import os
import socket
from urllib.parse import urlsplit

import psutil

from pipeline.data.executor import TlsFiles
from pipeline.orchestration.agent import AGENT_KEY_ENV, agent_key, serve
from pipeline.runtime.errors import UserError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.node", description=(
        "Serve this host as one node of a multi-host run: its Dask workers, hubs and trainers. "
        "Start one per host, then the driver with cluster.address=<scheduler> cluster.nodes=<hosts>. "
        "A Dask scheduler runs the pickled code its clients send: join only schedulers you trust."))
    parser.add_argument("scheduler", help="the Dask scheduler's address, e.g. tcp://10.0.0.1:8786 or tls://...")
    parser.add_argument("--node", type=int, required=True, help="this host's node number: 0, 1, ... (one each)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="Dask workers (cores)")
    parser.add_argument("--threads", type=int, default=1, help="threads per Dask worker")
    parser.add_argument("--host", help="the address other hosts reach this one at: its Dask workers, agent and "
                                       "process groups listen there (default: the one it reaches the scheduler from)")
    parser.add_argument("--interface", help="the network interface of the process groups' traffic between hosts "
                                            "(gloo, NCCL's sockets; default: the one --host is on)")
    parser.add_argument("--key-file", help="the secret shared with the driver (cluster.agent_key_file), a file "
                                           f"of mode 0600; without it, the environment variable {AGENT_KEY_ENV}")
    parser.add_argument("--host-s", type=float, default=30,
                        help="a driver whose host answers nothing this long (cut off, powered off) is gone: the "
                             "connections serving it break (the driver's timeouts.host_s bounds its own end)")
    parser.add_argument("--tls-ca-file", help="with a tls:// scheduler: the CA's certificate (PEM)")
    parser.add_argument("--tls-cert", help="with a tls:// scheduler: this host's certificate (PEM), presented to "
                                           "Dask and to the driver")
    parser.add_argument("--tls-key", help="with a tls:// scheduler: this host's private key (PEM)")
    args = parser.parse_args(argv)
    if args.node < 0 or args.workers < 1 or args.threads < 1 or args.host_s <= 0:
        parser.error("--node must be >= 0, --workers and --threads >= 1, --host-s > 0")
    tls_files = (args.tls_ca_file, args.tls_cert, args.tls_key)
    if args.scheduler.startswith("tls://") != all(tls_files) or any(tls_files) != all(tls_files):
        parser.error("a tls:// scheduler needs --tls-ca-file, --tls-cert and --tls-key, and they need a tls:// "
                     "scheduler")
    try:
        key = agent_key(args.key_file, "--key-file")
        host = args.host or address_towards(args.scheduler)
        interface = interface_for(host, args.interface)
    except UserError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    serve(args.scheduler, args.node, args.workers, args.threads, host, interface, key, args.host_s,
          TlsFiles(*tls_files) if all(tls_files) else None)


def address_towards(scheduler: str) -> str:
    """This host's address on the route to `scheduler` (a datagram socket's connect sends nothing). Not
    distributed.utils.get_ip: where there is no route, it falls back to the host name's address, a loopback
    one on most hosts, with a warning only."""
    target = urlsplit(scheduler if "://" in scheduler else f"tcp://{scheduler}")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((target.hostname, target.port or 8786))
            return sock.getsockname()[0]
    except (OSError, ValueError) as err:
        raise UserError(f"no route from this host to the scheduler {scheduler} ({err}): give the address other "
                        "hosts reach this one at with --host") from None


def interface_for(host: str, named: str | None) -> str:
    """The interface of process groups between hosts: `named` (--interface), else the one that holds
    `host`. A UserError if `host` is not this host's (an address of another host, or a name that does
    not resolve to one of its addresses), or if this host has no interface `named`."""
    try:
        wanted = socket.gethostbyname(host)
    except OSError:
        raise UserError(f"--host {host}: not an address this host resolves; give one of its own") from None
    interfaces = psutil.net_if_addrs()
    holding = [name for name, addresses in interfaces.items()
               if any(a.family == socket.AF_INET and a.address == wanted for a in addresses)]
    if not holding:
        own = sorted(a.address for addresses in interfaces.values() for a in addresses if a.family == socket.AF_INET)
        raise UserError(f"--host {host} is not an address of this host (it has {', '.join(own)}): give the one "
                        "other hosts reach it at")
    if named and named not in interfaces:
        raise UserError(f"--interface {named}: this host has no such interface; it has {', '.join(sorted(interfaces))}")
    return named or holding[0]


if __name__ == "__main__":
    main()
