"""A one-node Slurm on this machine for the sbatch tests, started once per session."""

from __future__ import annotations

import pytest


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
