"""`python -m pipeline.node <scheduler> --node <i>`: serve this host as one node
of a multi-host run: its Dask workers, hubs and trainers (pipeline/orchestration/node.py)."""
from __future__ import annotations

import argparse
import os
import socket

from pipeline.orchestration.node import serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.node", description=(
        "Serve this host as one node of a multi-host run: its Dask workers, hubs and trainers. "
        "Start one per host, then the driver with cluster.address=<scheduler> cluster.nodes=<hosts>."))
    parser.add_argument("scheduler", help="the Dask scheduler's address, e.g. tcp://10.0.0.1:8786")
    parser.add_argument("--node", type=int, required=True, help="this host's node number: 0, 1, ... (one each)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="Dask workers (cores)")
    parser.add_argument("--threads", type=int, default=1, help="threads per Dask worker")
    parser.add_argument("--host", default=socket.gethostbyname(socket.gethostname()),
                        help="the address other hosts reach this one at (process groups meet here)")
    args = parser.parse_args(argv)
    if args.node < 0 or args.workers < 1 or args.threads < 1:
        parser.error("--node must be >= 0, --workers and --threads >= 1")
    serve(args.scheduler, args.node, args.workers, args.threads, args.host)


if __name__ == "__main__":
    main()
