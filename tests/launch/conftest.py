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
