"""A closed network surface: a local run listens on loopback only, its files in shared memory are
its user's alone, remote schedulers speak TLS, and node agents serve only a driver holding their secret."""
import asyncio
import ipaddress
import multiprocessing as mp
import os
import re
import stat

import numpy as np
import psutil
import pytest

from pipeline.data.handoff import HANDOFF_PREFIX, SharedArray
from pipeline.runtime.lifetime import SHM_DIR, remove_shm
from pipeline.delivery.ring import Ring
from pipeline.delivery.stream import MessageLayout
from pipeline.orchestration.agent import AGENT_KEY_ENV, agent_key
from pipeline.runtime.errors import UserError
from tests.conftest import compose_config, resnet_override


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# --- shared memory -------------------------------------------------------------------------------

def test_hand_off_files_are_private_and_named_by_owner_and_a_random_part():
    prefix = f"{HANDOFF_PREFIX}-{os.getpid()}-test"
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    try:
        first, second = SharedArray.write(f"{prefix}-b0", array), SharedArray.write(f"{prefix}-b0", array)
        for shared in (first, second):
            assert re.fullmatch(rf"{prefix}-b0-[0-9a-f]{{16}}", shared.segment)
            assert mode(os.path.join(SHM_DIR, shared.segment)) == 0o600
        assert first.segment != second.segment  # a re-run task never lands on its first run's name
        assert np.array_equal(first.take(), array)
        assert not os.path.exists(os.path.join(SHM_DIR, first.segment))  # taken: unlinked
    finally:
        remove_shm(prefix)  # stale files are found by the owner's pid
    assert not [name for name in os.listdir(SHM_DIR) if name.startswith(prefix)]


def test_a_planted_link_is_neither_followed_nor_overwritten(tmp_path, monkeypatch):
    """Even an attacker who knew the random parts gains nothing: a link planted at the temporary
    name makes the write fail (O_EXCL); one planted at the final name is replaced, not followed."""
    import pipeline.data.handoff as handoff

    monkeypatch.setattr(handoff.secrets, "token_hex", lambda n: "0" * 2 * n)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    prefix = f"{HANDOFF_PREFIX}-{os.getpid()}-planted"
    final = os.path.join(SHM_DIR, f"{prefix}-{'0' * 16}")
    try:
        os.symlink(victim, f"{final}.partial-{'0' * 16}")
        with pytest.raises(FileExistsError):
            SharedArray.write(prefix, np.ones(4, np.uint8))
        os.unlink(f"{final}.partial-{'0' * 16}")
        os.symlink(victim, final)
        shared = SharedArray.write(prefix, np.ones(4, np.uint8))
        assert not os.path.islink(final) and mode(final) == 0o600
        assert np.array_equal(shared.take(), np.ones(4, np.uint8))
        assert victim.read_bytes() == b"precious"
    finally:
        remove_shm(prefix)


def test_ring_segments_are_private_and_named_by_their_owner():
    ring = Ring("h0-main", MessageLayout(4, (8, 8, 3)), readers=1, depth=2, context=mp.get_context("spawn"))
    try:
        assert re.fullmatch(rf"ensemble-{os.getpid()}-[0-9a-f]{{8}}-h0-main", ring.segment)
        assert mode(os.path.join(SHM_DIR, ring.segment)) == 0o600
    finally:
        ring.close()


# --- the agents' secret --------------------------------------------------------------------------

def test_the_agents_secret_comes_from_a_private_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(AGENT_KEY_ENV, raising=False)
    key_file = tmp_path / "agent.key"
    key_file.write_text("a" * 32 + "\n")
    key_file.chmod(0o644)
    with pytest.raises(UserError, match=rf"cluster.agent_key_file={key_file} is mode 644: .*chmod 600 {key_file}"):
        agent_key(str(key_file), "cluster.agent_key_file")
    key_file.chmod(0o600)
    assert agent_key(str(key_file), "cluster.agent_key_file") == b"a" * 32
    with pytest.raises(UserError, match=rf"give cluster.agent_key_file=<file> \(mode 0600\) or set {AGENT_KEY_ENV}"):
        agent_key(None, "cluster.agent_key_file")
    monkeypatch.setenv(AGENT_KEY_ENV, "short")
    with pytest.raises(UserError, match=rf"{AGENT_KEY_ENV}: the agents' secret has 5 bytes, fewer than 16"):
        agent_key(None, "cluster.agent_key_file")
    monkeypatch.setenv(AGENT_KEY_ENV, "b" * 16)
    assert agent_key(None, "cluster.agent_key_file") == b"b" * 16


def test_an_agent_refuses_to_start_without_a_secret(monkeypatch, capsys):
    from pipeline.node import main

    monkeypatch.delenv(AGENT_KEY_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["tcp://127.0.0.1:1", "--node", "0"])
    assert exit_.value.code == 2
    assert "node agents need a secret shared with the driver: give --key-file=<file>" in capsys.readouterr().err


# --- a local run listens on loopback only --------------------------------------------------------

MODELS = f"[{resnet_override('A')}, {resnet_override('B', 'alt', slots=2)}]"


def _listening(process: psutil.Process) -> set[str]:
    try:
        return {c.laddr.ip for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    except psutil.NoSuchProcess:
        return set()


@pytest.mark.slow
def test_a_local_run_listens_on_loopback_only(tiny_dataset, tmp_path, monkeypatch):
    """Two simulated nodes, so the hubs exchange over gloo, and a DDP model (gloo between its
    trainers). Once the driver has DDP model B's first report (every process of the run is up and in
    its process groups: A's alone could come before B's trainers had met), the sockets the run's
    process tree listens on are all on loopback, its rings are private, and its process groups met
    through files in a private folder."""
    from pipeline.orchestration.flotilla import Flotilla
    from pipeline.run import run
    from pipeline.training.reports import TrainReport

    seen: dict = {}
    poll = Flotilla.poll

    def poll_and_look(self, timeout=None):
        reports = poll(self, timeout)
        if not seen and any(isinstance(r, TrainReport) and r.model == "B" for r in reports):
            tree = [psutil.Process(), *psutil.Process().children(recursive=True)]
            seen["listening"] = {p.pid: _listening(p) for p in tree}
            seen["roles"] = {p.pid: p.name for p in mp.active_children()}
            seen["rings"] = {name: mode(os.path.join(SHM_DIR, name)) for name in os.listdir(SHM_DIR)
                             if name.startswith(f"ensemble-{os.getpid()}-")}
            seen["rendezvous"] = {node.local.folder: (mode(node.local.folder), os.listdir(node.local.folder))
                                  for node in self.nodes.values()}
        return reports

    monkeypatch.setattr(Flotilla, "poll", poll_and_look)
    cfg = compose_config(["+ensemble=caltech256", f"ensemble.models={MODELS}", "topology=all_shared",
                          f"dataset.root={tiny_dataset}", "dataset.synthetic=never", "pipeline.batch_size=16",
                          "pipeline.image_size=32", "pipeline.alt_image_size=24", "cluster.workers=2",
                          "cluster.nodes=2", "trainer.slots=4", "trainer.epochs=1", "trainer.consume_only=true"])
    run(cfg, tmp_path / "out")

    listening, roles = seen["listening"], seen["roles"]
    addresses = {ip for ips in listening.values() for ip in ips}
    assert addresses and all(ipaddress.ip_address(ip).is_loopback for ip in addresses), listening
    # What listens there: the Dask scheduler (here), its workers, and gloo in every hub and DDP trainer.
    assert listening[os.getpid()]
    for role in ("hub-0-", "hub-1-", "trainer-B-0", "trainer-B-1", "Dask Worker"):
        assert any(name.startswith(role) and listening[pid] for pid, name in roles.items()), (role, roles)
    assert len(seen["rings"]) >= 2 and set(seen["rings"].values()) == {0o600}
    # Each node's folder holds the files its groups met through: the hubs' group and B's on node 0.
    assert sorted(len(files) for _, files in seen["rendezvous"].values()) == [0, 2]
    assert {folder_mode for folder_mode, _ in seen["rendezvous"].values()} == {0o700}
    assert not any(os.path.exists(folder) for folder in seen["rendezvous"])  # removed with the flotilla


# --- TLS to a remote scheduler -------------------------------------------------------------------

@pytest.mark.slow
def test_a_tls_scheduler_takes_the_configured_client_and_refuses_others(tls, tmp_path):
    from dask.distributed import LocalCluster, Security, comm

    from pipeline.config import check
    from pipeline.data.executor import TlsFiles, dask_client

    security, files = tls
    with LocalCluster(n_workers=1, threads_per_worker=1, protocol="tls://", host="127.0.0.1", security=security,
                      dashboard_address=None) as cluster:
        cfg = compose_config(["+ensemble=caltech256", f"cluster.address={cluster.scheduler_address}",
                              f"cluster.tls.ca_file={files.ca_file}", f"cluster.tls.cert={files.cert}",
                              f"cluster.tls.key={files.key}"])
        check(cfg)
        with dask_client(cfg.cluster.address, "auto", 1, tls=TlsFiles.configured(cfg.cluster.tls)) as client:
            assert client.submit(sum, [1, 2]).result() == 3
        # Raw connections (a sync Client that fails to connect hangs as it is collected): the configured
        # files reach the scheduler; plain TCP and a certificate its CA never signed do not.
        async def reach(address, security):
            await (await comm.connect(address, timeout="3s", **security.get_connection_args("client"))).close()

        asyncio.run(reach(cluster.scheduler_address, TlsFiles.configured(cfg.cluster.tls).security()))
        for address, refused in ((cluster.scheduler_address.replace("tls://", "tcp://"), Security()),
                                 (cluster.scheduler_address, Security.temporary())):
            with pytest.raises(OSError):
                asyncio.run(reach(address, refused))


@pytest.mark.parametrize("overrides, message", [
    (["cluster.address=tls://10.0.0.1:8786"], r"cluster.address=tls://10.0.0.1:8786 needs Dask's TLS files; "
                                              r"cluster.tls.ca_file, cluster.tls.cert, cluster.tls.key not set"),
    (["cluster.address=tcp://10.0.0.1:8786", "cluster.tls.ca_file=ca.pem"], r"starts with tls://"),
    (["cluster.tls.ca_file=ca.pem"], r"cluster.tls.ca_file is set but a local cluster listens on loopback only"),
    (["cluster.address=tls://10.0.0.1:8786", "cluster.tls.ca_file=/nonexistent.pem", "cluster.tls.cert=c",
      "cluster.tls.key=k"], r"cluster.tls.ca_file=/nonexistent.pem: no such readable file"),
])
def test_tls_settings_are_checked_before_a_run(overrides, message):
    from pipeline.config import ConfigError, check

    with pytest.raises(ConfigError, match=message):
        check(compose_config(["+ensemble=caltech256", *overrides]))
