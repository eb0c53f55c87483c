"""Between nodes: the hubs of a stream exchange batches over the stream's
own torch.distributed process group (gloo on CPU, NCCL on GPUs).

A batch (every sink's images and labels, and a header) travels as one flat
uint8 tensor of fixed size, so each exchange is one collective call.
"""
from __future__ import annotations

import datetime
import os
import shutil
import socket
import time
import uuid
from contextlib import contextmanager

import numpy as np

from pipeline.runtime.hang import HangError
from pipeline.runtime.lifetime import rendezvous_folder

LOOPBACK = "127.0.0.1"
LOOPBACK_INTERFACE = "lo"  # Linux's loopback device, for gloo and NCCL


def rendezvous_at(host: str) -> str:
    """init_method (a free TCP port) for a torch.distributed process group whose rank 0 runs on `host`,
    for groups spanning hosts: rank 0's store listens there, on that address only (`init_process_group`)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"


def use_interface(name: str) -> None:
    """The network interface this process and its children's process groups use (gloo's and NCCL's own
    sockets): without it, gloo takes the address the host name resolves to, a loopback one on most Linux
    hosts (/etc/hosts' 127.0.1.1 line), and a group spanning hosts cannot connect."""
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = name


class LocalRendezvous:
    """Process groups whose ranks all run on this host meet through a file in a folder of the
    owner's own (mode 0700): no socket is opened. Each group gets a new file (a FileStore
    holds one group's keys); `close` removes the folder once the groups are gone (the owner's
    children, or the next run, if it is killed outright)."""

    def __init__(self):
        self.folder = rendezvous_folder()

    def next(self) -> str:
        return f"file://{self.folder}/{uuid.uuid4().hex}"

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def init_process_group(init_method: str, rank: int, world: int, device: str, timeout_s: float, what: str) -> None:
    """Join a process group (`what` names it in errors): NCCL between GPUs, gloo on CPU. A group met
    through a file (LocalRendezvous) has every rank on this host: gloo and NCCL's bootstrap listen on
    loopback. Its collectives, and the rendezvous itself, fail after `timeout_s` (timeouts.collective_s)
    instead of waiting for ever."""
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    if init_method.startswith("file://"):
        use_interface(LOOPBACK_INTERFACE)
    if backend == "nccl":  # NCCL waits for ever unless told to raise (blocking wait) and not to kill the process
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # clean up only: the error is ours to raise
    timeout = datetime.timedelta(seconds=timeout_s)
    with completes(f"the rendezvous of {what} (rank {rank} of {world}, at {init_method})", timeout_s):
        if init_method.startswith("tcp://"):
            dist.init_process_group(backend, store=_tcp_store(init_method, rank, world, timeout), rank=rank,
                                    world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)


def _tcp_store(init_method: str, rank: int, world: int, timeout: datetime.timedelta):
    """The store of a group met at tcp://host:port. Rank 0's listens on `host` only (torch's own would listen
    on every interface of the host: the store answers anyone who reaches it)."""
    import torch.distributed as dist

    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    if rank != 0:
        return dist.TCPStore(host, int(port), world, False, timeout)
    listening = socket.create_server((host, int(port)))
    return dist.TCPStore(host, int(port), world, True, timeout, master_listen_fd=listening.detach())  # it owns it


def make_groups(all_ranks: tuple[tuple[int, ...], ...], timeout_s: float) -> list:
    """The process group of each ranks in `all_ranks`. new_group is collective over the world: every
    process makes every group, in the same order. Each gets `timeout_s`: a group does not inherit the world's."""
    import torch.distributed as dist

    return [dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s)) for ranks in all_ranks]


@contextmanager
def completes(what: str, timeout_s: float):
    """Around torch.distributed calls (gloo and NCCL raise RuntimeError): one that ran out its
    `timeout_s` is a HangError naming `what` and timeouts.collective_s; a peer lost sooner gets `what`
    added to torch's own message."""
    started = time.monotonic()
    try:
        yield
    except RuntimeError as err:
        waited = time.monotonic() - started
        if waited >= timeout_s:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise HangError(f"{what} did not complete in {timeout_s:g} s (timeouts.collective_s): a peer stalled "
                            f"or left; the peer's own messages say why ({first})") from None
        err.add_note(f"during {what}, after {waited:.1f} s: a peer left? (timeouts.collective_s={timeout_s:g})")
        raise


Sinks = dict[str, tuple[np.ndarray, np.ndarray]]  # sink -> (images [n, h, w, c] uint8, labels [n] int64)


class BatchCodec:
    """Packs a batch of up to `capacity` items per sink into a flat buffer."""

    def __init__(self, item_shapes: dict[str, tuple[int, ...]], capacity: int):
        self.item_shapes, self.capacity = dict(sorted(item_shapes.items())), capacity
        self.header = 8 * (1 + len(self.item_shapes))  # index, then the item count of each sink
        self.size = self.header + sum(capacity * (8 + int(np.prod(shape))) for shape in self.item_shapes.values())

    def _views(self, buf: np.ndarray):
        header = buf[:self.header].view(np.int64)
        offset, views = self.header, {}
        for sink, shape in self.item_shapes.items():
            labels = buf[offset:offset + 8 * self.capacity].view(np.int64)
            offset += 8 * self.capacity
            images = buf[offset:offset + self.capacity * int(np.prod(shape))].reshape(self.capacity, *shape)
            offset += images.nbytes
            views[sink] = (images, labels)
        return header, views

    def pack(self, index: int, sinks: Sinks, buf: np.ndarray) -> None:
        header, views = self._views(buf)
        header[0] = index
        for position, (sink, (images, labels)) in enumerate(views.items(), start=1):
            given_images, given_labels = sinks[sink]
            count = len(given_labels)
            if count > self.capacity:
                raise ValueError(f"sink {sink}: {count} items exceed the exchange capacity {self.capacity}")
            header[position] = count
            images[:count] = given_images
            labels[:count] = given_labels

    def unpack(self, buf: np.ndarray) -> tuple[int, Sinks]:
        header, views = self._views(buf)
        return int(header[0]), {sink: (images[:header[position]], labels[:header[position]])
                                for position, (sink, (images, labels)) in enumerate(views.items(), start=1)}


def exchange_bytes(item_shapes: dict[str, tuple[int, ...]], batch_size: int, hubs: int) -> int:
    """Device memory a hub's exchange buffers take (StreamLink: one buffer per hub of its stream, plus its
    own share): what a GPU hosting a hub lends it, counted in the memory check."""
    return (hubs + 1) * BatchCodec(item_shapes, batch_size).size


class StreamLink:
    """A stream's hubs: `ranks` in the hubs' world, `group` their
    process group; a broadcast's root is ranks[0], an all-gather's shares
    come in rank order (share i from ranks[i]). Exchange buffers are made
    once (pinned on the host when the exchange runs on a GPU); a batch
    received is valid until the next exchange (the hub writes it into its
    rings at once)."""

    def __init__(self, group, ranks: tuple[int, ...], item_shapes: dict[str, tuple[int, ...]], batch_size: int,
                 gather: bool, device: str, timeout_s: float):
        import torch

        self.torch, self.group, self.ranks, self.gather = torch, group, ranks, gather
        self.timeout_s = timeout_s  # timeouts.collective_s: the stream's process group has it too
        self.device = torch.device(device)
        self.codec = BatchCodec(item_shapes, -(-batch_size // len(ranks)) if gather else batch_size)
        self.bytes_sent = self.bytes_received = 0
        on_gpu = self.device.type == "cuda"
        host = lambda: torch.empty(self.codec.size, dtype=torch.uint8, pin_memory=on_gpu)
        # gloo exchanges host memory: there the device buffer is the host one (copy_ onto itself returns at once)
        device_copy = (lambda t: torch.empty_like(t, device=self.device)) if on_gpu else (lambda t: t)
        self.host = [host() for _ in ranks]  # one per share (an all-gather's); a broadcast uses the first
        self.on_device = [device_copy(t) for t in self.host]
        self.mine_host = host()
        self.mine = device_copy(self.mine_host)

    def broadcast(self, rank: int, index: int, sinks: Sinks | None) -> Sinks:
        """The root passes its batch; every hub returns it."""
        import torch.distributed as dist

        host, on_device = self.host[0], self.on_device[0]
        if rank == self.ranks[0]:
            self.codec.pack(index, sinks, host.numpy())
            self.bytes_sent += self.codec.size * (len(self.ranks) - 1)
            on_device.copy_(host)
        else:
            self.bytes_received += self.codec.size
        with completes(f"hub {rank}'s broadcast of batch {index} from hub {self.ranks[0]} to the stream's "
                       f"hubs {list(self.ranks)}", self.timeout_s):
            dist.broadcast(on_device, src=self.ranks[0], group=self.group)
        host.copy_(on_device)
        received_index, received = self.codec.unpack(host.numpy())
        if received_index != index:  # hubs must walk the epoch in step; anything else is a bug
            raise RuntimeError(f"hub {rank} expected batch {index}, the broadcast carried {received_index}")
        return received

    def all_gather(self, rank: int, index: int, share: Sinks) -> Sinks:
        """Every hub passes its share; every hub returns the whole batch."""
        import torch.distributed as dist

        self.codec.pack(index, share, self.mine_host.numpy())
        self.mine.copy_(self.mine_host)
        with completes(f"hub {rank}'s all-gather of batch {index} among the stream's hubs {list(self.ranks)}",
                       self.timeout_s):
            dist.all_gather(self.on_device, self.mine, group=self.group)
        self.bytes_sent += self.codec.size * (len(self.ranks) - 1)
        self.bytes_received += self.codec.size * (len(self.ranks) - 1)
        for host, on_device in zip(self.host, self.on_device):
            host.copy_(on_device)
        shares = [self.codec.unpack(buf.numpy()) for buf in self.host]
        if any(got != index for got, _ in shares):
            raise RuntimeError(f"all-gather of batch {index} carried batches {[got for got, _ in shares]}")
        return {sink: (np.concatenate([s[sink][0] for _, s in shares]),
                       np.concatenate([s[sink][1] for _, s in shares])) for sink in self.codec.item_shapes}
