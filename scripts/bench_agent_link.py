"""Benchmark of what TLS costs the driver-agent link (docs/benchmarks.md, The agent link): an agent's
manager served on loopback, called by a driver as a run calls it, plain and with TLS (a throwaway CA
and certificate, Dask's Security.temporary, as the tests make them):

* connect: a new manager connected (TCP, the TLS handshake, the secret's challenge both ways), and its
  first object created, as a flotilla does once per node;
* small call: a call with a few bytes each way (a poll of the node's processes);
* 100 kB call: a call carrying 100 kB (a large spec).

Rounds alternate between plain and TLS, each going first in turn, so that both see the same machine; the
medians are printed, and TLS's ratio to plain.

    python scripts/bench_agent_link.py --rounds 5 --calls 500
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

from distributed import Security

from pipeline.data.executor import TlsFiles
from pipeline.orchestration.link import Link
from pipeline.orchestration.agent import _Agent, _proxy_type

KEY = b"0123456789abcdef" * 2
LOOPBACK = "127.0.0.1"


class Echoes:
    def echo(self, value):
        return value


class Agent(_Agent):
    pass


Agent.register("Echoes", Echoes, proxytype=_proxy_type(Echoes))


def one_round(tls: TlsFiles | None, calls: int) -> dict[str, float]:
    """Seconds per connect, per small call and per 100 kB call, on an agent served for this round."""
    served = Agent((LOOPBACK, 0), KEY, Link(None, tls))
    served.start()
    try:
        link = Link(30, tls)
        start = time.perf_counter()
        for _ in range(calls // 10):
            manager = Agent(served.address, KEY, link)
            manager.connect()
            manager.Echoes()
        connect_s = (time.perf_counter() - start) / (calls // 10)
        remote = manager.Echoes()
        timed = {}
        for name, value in (("small call", b"poll"), ("100 kB call", bytes(100_000))):
            remote.echo(value)  # the thread's connection made
            start = time.perf_counter()
            for _ in range(calls):
                remote.echo(value)
            timed[name] = (time.perf_counter() - start) / calls
        return {"connect": connect_s, **timed}
    finally:
        served.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=500,
                        help="calls of each kind per round (a tenth as many connects)")
    args = parser.parse_args()
    security = Security.temporary()  # Dask takes PEM text where a file's path goes
    tls = TlsFiles(security.tls_ca_file, security.tls_client_cert, security.tls_client_key)
    kinds = {"plain": None, "tls": tls}
    times: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    for index in range(args.rounds):
        order = list(kinds) if index % 2 == 0 else list(reversed(kinds))
        for kind in order:
            times[kind].append(one_round(kinds[kind], args.calls))
    print(f"{platform.processor() or platform.machine()}, {args.rounds} rounds x {args.calls} calls, loopback")
    print(f"{'':14}{'plain':>12}{'tls':>12}{'tls / plain':>14}")
    for what in times["plain"][0]:
        plain = statistics.median(t[what] for t in times["plain"])
        secure = statistics.median(t[what] for t in times["tls"])
        print(f"{what:14}{plain * 1e6:>10.0f}us{secure * 1e6:>10.0f}us{secure / plain:>13.2f}x")


if __name__ == "__main__":
    main()
