"""Hosts for multi-node launch tests: network namespaces joined by a bridge, made once per
module and torn down after it; where they cannot be made (not root, no iproute2), the
tests that ask for them skip with the reason."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.netns import Hosts, hosts_or_skip


@pytest.fixture(scope="module")
def netns_hosts() -> Iterator[Hosts]:
    """Two hosts on one network, sharing the machine's hostname and filesystem."""
    with hosts_or_skip(2) as hosts:
        yield hosts


@pytest.fixture(scope="session")
def slurm_localhost() -> str:
    """A one-node Slurm on this machine, started once by scripts/slurm_localhost.sh; skips
    with the script's own reason where it cannot start (not root, no apt-get, no network).
    Returns the node's name."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "slurm_localhost.sh"
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.skip((done.stderr.strip() or done.stdout.strip() or "scripts/slurm_localhost.sh failed").splitlines()[-1])
    node = subprocess.run(["sinfo", "-h", "-o", "%N"], capture_output=True, text=True, check=True)
    return node.stdout.strip()
