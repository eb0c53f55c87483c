"""The connections between the driver and the node agents (agent.py).

They are multiprocessing's connections, carrying its manager protocol: pickled
messages, and an HMAC challenge with the agents' secret on every connection.
A `Link` says how they run on TCP:

* `host_s`: the connection breaks once the peer's host has answered nothing
  for about that long (keepalive probes, a user timeout, a bounded connect),
  so a host cut off or powered off is noticed, and a busy one never is;
* `tls`: with the cluster's Dask certificates (cluster.tls, an agent's
  --tls-*), every connection is TLS, both ends presenting a certificate
  signed by the cluster's CA, with Dask's own settings (its Security), so that
  whoever can join the cluster's Dask can reach its agents and no one else can
  read or forge what they say.

A manager finds its protocol's Listener and Client in multiprocessing's table
`listener_client` under the name of its serializer; `serializer_for` enters
a Link there, under itself.
"""
from __future__ import annotations

import functools
import os
import socket
import ssl
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from multiprocessing import connection
from multiprocessing.managers import listener_client

from pipeline.data.executor import TlsFiles

LISTEN_BACKLOG = 16  # multiprocessing's manager listens with this


@dataclass(frozen=True)
class Link:
    """How the connections between the driver and an agent run: each end makes its own, from its settings."""

    host_s: float | None  # a peer host silent this long is gone (None: wait for it as long as it takes)
    tls: TlsFiles | None  # the Dask certificates of this end (None: plain TCP)

    def listen(self, address: tuple[str, int], backlog: int = LISTEN_BACKLOG, authkey: bytes | None = None):
        """connection.Listener's equal: what it accepts are this link's connections (with `authkey`, only
        those that prove they hold it)."""
        return _Listener(self, address, backlog, authkey)

    def connect(self, address: tuple[str, int], authkey: bytes | None = None) -> connection.Connection:
        """connection.Client's equal: a connection to `address` (with `authkey`: proving both ends hold it).
        Each step of connecting, the TLS handshake and the challenge waits host_s at most."""
        with _failure_of_the_link():
            link = self._over(socket.create_connection(address, timeout=self.host_s), server_side=False)
        if authkey is not None:
            connection.answer_challenge(link, authkey)
            connection.deliver_challenge(link, authkey)
        link.sock.settimeout(None)
        return link

    def _over(self, sock: socket.socket, server_side: bool) -> _Connection:
        # Calls are small messages, each waited for: Nagle's algorithm would hold one back until the peer
        # acknowledged the last, which it delays (40 ms and more; a new manager's first object took 220 ms).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.host_s is not None:
            _bound_silence(sock, self.host_s)
        # TLS: the handshake is made by the first read or write; in an agent, that is in the thread serving
        # the connection, not in the one accepting the next.
        return _Connection(sock) if self.tls is None else _TlsConnection(sock, _context(self.tls, server_side),
                                                                          server_side)


    def __reduce__(self):  # unpickled (a manager's server started under spawn, a proxy sent on): registered
        return _registered, (self.host_s, self.tls)


def serializer_for(link: Link) -> Link:
    """`link` as a manager's serializer: its connections are the link's. Its TLS contexts are made here, so
    that files that cannot be used fail now, not as a connection that failed."""
    for server_side in (True, False) if link.tls is not None else ():
        _context(link.tls, server_side)
    listener_client.setdefault(link, (link.listen, link.connect))
    return link


def _registered(host_s: float | None, tls: TlsFiles | None) -> Link:
    return serializer_for(Link(host_s, tls))


class _Listener:
    """The interface of connection.Listener (address, accept, close, with) on a Link."""

    def __init__(self, link: Link, address: tuple[str, int], backlog: int, authkey: bytes | None):
        self.link, self.authkey = link, authkey
        self.socket = socket.create_server(address, backlog=backlog)
        self.address = self.socket.getsockname()[:2]

    def accept(self) -> connection.Connection:
        sock, _ = self.socket.accept()
        link = self.link._over(sock, server_side=True)
        if self.authkey is not None:
            connection.deliver_challenge(link, self.authkey)
            connection.answer_challenge(link, self.authkey)
        return link

    def close(self) -> None:
        self.socket.close()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()


_IMPORTED_HERE = os.urandom(8)  # with the pid (a forked child has both), marks this process's link failures


def _this_process() -> tuple[bytes, int]:
    return _IMPORTED_HERE, os.getpid()


def broke_the_link(err: BaseException) -> bool:
    """Whether `err` is a link's own failure (its connection broke, or could not be made), not an error
    raised at the other end and sent back through it (tracebacks, attributes and all)."""
    return getattr(err, "broke_the_link", None) == _this_process()


@contextmanager
def _failure_of_the_link():
    try:
        yield
    except (EOFError, OSError) as err:
        err.broke_the_link = _this_process()
        raise


class _Connection(connection.Connection):
    """multiprocessing's Connection on a Link's socket, read and written through the socket object (so that
    its timeout holds); a failure to read or write is the link's."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        super().__init__(sock.fileno())

    def _send(self, buf, write=None):
        with _failure_of_the_link():
            self._send_all(buf)

    def _recv(self, size, read=None):
        with _failure_of_the_link():
            return super()._recv(size, lambda _, most: self._receive(most))

    def _close(self, _close=None):
        self.sock.close()

    def _send_all(self, data) -> None:
        self.sock.sendall(data)

    def _receive(self, most: int) -> bytes:
        return self.sock.recv(most)


class _TlsConnection(_Connection):
    """A Connection whose bytes go through TLS. Its records are read and written here, on the socket, whose
    errors are then its own (through the ssl module's sockets, a peer silent past TCP_USER_TIMEOUT came out
    as EOF in tests/test_hosts.py, and a host cut off read as one that closed)."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool):
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=server_side)
        super().__init__(sock)

    def _send_all(self, data) -> None:
        data = memoryview(data)
        while data:
            data = data[self._until_done(lambda: self.tls.write(data)):]

    def _receive(self, most: int) -> bytes:
        return self._until_done(lambda: self.tls.read(most))

    def _poll(self, timeout):
        # received and not read yet: decrypted, or a record (whole or in part, as a socket's poll counts a
        # message begun)
        return self.tls.pending() > 0 or self.incoming.pending > 0 or super()._poll(timeout)

    def _until_done(self, step):
        """`step` of the TLS machine (a handshake first if it is not made yet), records sent and received on
        the socket until it is done."""
        while True:
            try:
                done = step()
            except ssl.SSLWantReadError:
                self._flush()
                received = self.sock.recv(1 << 16)
                if received:
                    self.incoming.write(received)
                else:
                    self.incoming.write_eof()
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                raise EOFError from None  # the peer closed, cleanly or not: the end of the stream, as on a socket
            except ssl.SSLError:
                with suppress(OSError):
                    self._flush()  # the alert that tells the peer why
                raise
            else:
                self._flush()
                return done

    def _flush(self) -> None:
        if self.outgoing.pending:
            self.sock.sendall(self.outgoing.read())


@functools.lru_cache(maxsize=None)
def _context(tls: TlsFiles, server_side: bool) -> ssl.SSLContext:
    """Dask's TLS context for these files: both ends verified against the cluster's CA (not by host name:
    Dask's convention, certificates are often shared by hosts reached by address)."""
    security = tls.security()
    args = security.get_listen_args("client") if server_side else security.get_connection_args("client")
    return args["ssl_context"]


def _bound_silence(sock: socket.socket, host_s: float) -> None:
    """`sock` breaks once its peer's host has answered nothing for about `host_s`: the kernel probes it while
    idle (keepalive, answered by the peer's kernel however busy the peer process) and gives up on data it
    does not acknowledge (TCP_USER_TIMEOUT). A call blocked on it then raises TimeoutError instead of
    waiting for a host powered off or cut off."""
    probe_s = max(1, round(host_s / 4))  # idle this long, then 3 probes this far apart: about host_s
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, probe_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, probe_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(host_s * 1000))
