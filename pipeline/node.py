"""`python -m pipeline.node <scheduler> --node <i> --key-file agent.key`: serve this host as one node
of a multi-host run: its Dask workers, hubs and trainers (pipeline/orchestration/node.py)."""
from __future__ import annotations

import argparse
import os
import socket

from pipeline.data.executor import TlsFiles
from pipeline.orchestration.node import AGENT_KEY_ENV, agent_key, serve
from stages.base import UserError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.node", description=(
        "Serve this host as one node of a multi-host run: its Dask workers, hubs and trainers. "
        "Start one per host, then the driver with cluster.address=<scheduler> cluster.nodes=<hosts>. "
        "A Dask scheduler runs the pickled code its clients send: join only schedulers you trust."))
    parser.add_argument("scheduler", help="the Dask scheduler's address, e.g. tcp://10.0.0.1:8786 or tls://...")
    parser.add_argument("--node", type=int, required=True, help="this host's node number: 0, 1, ... (one each)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="Dask workers (cores)")
    parser.add_argument("--threads", type=int, default=1, help="threads per Dask worker")
    parser.add_argument("--host", default=socket.gethostbyname(socket.gethostname()),
                        help="the address other hosts reach this one at (process groups meet here)")
    parser.add_argument("--key-file", help="the secret shared with the driver (cluster.agent_key_file), a file "
                                           f"of mode 0600; without it, the environment variable {AGENT_KEY_ENV}")
    parser.add_argument("--tls-ca-file", help="with a tls:// scheduler: the CA's certificate (PEM)")
    parser.add_argument("--tls-cert", help="with a tls:// scheduler: this host's certificate (PEM)")
    parser.add_argument("--tls-key", help="with a tls:// scheduler: this host's private key (PEM)")
    args = parser.parse_args(argv)
    if args.node < 0 or args.workers < 1 or args.threads < 1:
        parser.error("--node must be >= 0, --workers and --threads >= 1")
    tls_files = (args.tls_ca_file, args.tls_cert, args.tls_key)
    if args.scheduler.startswith("tls://") != all(tls_files) or any(tls_files) != all(tls_files):
        parser.error("a tls:// scheduler needs --tls-ca-file, --tls-cert and --tls-key, and they need a tls:// "
                     "scheduler")
    try:
        key = agent_key(args.key_file, "--key-file")
    except UserError as err:
        parser.error(str(err))
    serve(args.scheduler, args.node, args.workers, args.threads, args.host, key,
          TlsFiles(*tls_files) if all(tls_files) else None)


if __name__ == "__main__":
    main()
