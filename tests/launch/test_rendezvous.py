"""The local rendezvous: one store, reachable from this machine only."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from meshyard.launch.local import launch_config
from meshyard.launch.rendezvous import BACKEND, LOOPBACK
from tests.launch.sockets import listening


def test_store_listens_on_loopback_only_and_is_shared_with_workers():
    config = launch_config(nproc=2)
    params = RendezvousParameters(config.rdzv_backend, config.rdzv_endpoint, config.run_id, 1, 1,
                                  **config.rdzv_configs)
    handler = rendezvous_handler_registry.create_handler(params)
    info = handler.next_rendezvous()
    bootstrap = info.bootstrap_store_info
    assert config.rdzv_backend == BACKEND and handler.use_agent_store
    assert (bootstrap.master_addr, info.rank, info.world_size) == (LOOPBACK, 0, 1)
    assert listening(port=bootstrap.master_port) == ["127.0.0.1"]

    # Workers reach the very store the agent uses (as env:// clients do), and the agent's
    # keys stay under the run id, apart from theirs.
    worker = dist.TCPStore(LOOPBACK, bootstrap.master_port, is_master=False, timeout=timedelta(seconds=10))
    info.store.set("agent-key", "a")
    worker.set("worker-key", "w")
    assert worker.get(f"{config.run_id}/agent-key") == b"a"
    assert info.store.check(["worker-key"]) is False

    again = handler.next_rendezvous()  # a restart round: the same store, no second server
    assert again.bootstrap_store_info.master_port == bootstrap.master_port
    assert listening(port=bootstrap.master_port) == ["127.0.0.1"]
    assert handler.shutdown() and handler.is_closed()
