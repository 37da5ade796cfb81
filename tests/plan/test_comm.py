"""Collective costs: ring volumes, placement on nodes, bandwidth of the slowest link."""

from __future__ import annotations

import math

import pytest

from meshyard.plan.comm import (
    collective_time, group_bandwidth, group_latency, p2p_time, place_group, place_mesh, ring_factor,
)
from meshyard.plan.hardware import make_cluster

CLUSTER = make_cluster("h100", 64, 8, "ib-ndr-8x", link_efficiency=1.0)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64, 4096])
def test_ring_volumes(n):
    """A ring all-reduce sends 2 (n - 1) / n of the buffer per rank; all-gather and
    reduce-scatter (n - 1) / n of the full buffer; point-to-point all of it."""
    assert ring_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert ring_factor("all_gather", n) == pytest.approx((n - 1) / n)
    assert ring_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    assert ring_factor("p2p", n) == 1.0
    # An all-reduce is a reduce-scatter followed by an all-gather.
    assert ring_factor("all_reduce", n) == pytest.approx(ring_factor("reduce_scatter", n) + ring_factor("all_gather", n))


def test_single_rank_costs_nothing():
    assert ring_factor("all_reduce", 1) == 0.0
    assert collective_time(CLUSTER, "all_reduce", 1e9, place_group(1, 1, 8)) == 0.0


def test_collective_time_is_volume_over_bandwidth_plus_latency():
    group = place_group(8, 1, 8)  # one full node
    nbytes = 1e9
    expected = 2 * 7 / 8 * nbytes / 450e9 + 2 * 7 * CLUSTER.intra.latency
    assert collective_time(CLUSTER, "all_reduce", nbytes, group) == pytest.approx(expected)


def test_placement_follows_the_mesh_order():
    """tp is innermost (adjacent ranks), then dp_shard, dp_replicate, pp."""
    mesh = place_mesh(CLUSTER, dp_replicate=4, dp_shard=2, tp=8, pp=2)
    assert not mesh.tp.crosses_nodes and mesh.tp.ranks_per_node == 8
    assert mesh.dp_shard.crosses_nodes and mesh.dp_shard.ranks_per_node == 1 and mesh.dp_shard.nodes == 2
    assert mesh.dp_replicate.nodes == 4
    assert mesh.pp_crosses_nodes
    small = place_mesh(CLUSTER.with_gpus(8), dp_replicate=1, dp_shard=4, tp=2, pp=1)
    assert not small.dp_shard.crosses_nodes and small.dp_shard.ranks_per_node == 4


def test_inter_node_bandwidth_is_shared_by_concurrent_groups():
    """A group with every GPU of each node gets all the node's NICs; one GPU per node
    (eight such groups at once) gets one rail."""
    full = place_group(64, 1, 8)
    rail = place_group(8, 8, 8)
    assert full.ranks_per_node == 8 and full.nodes == 8
    assert group_bandwidth(CLUSTER, full) == pytest.approx(400e9)
    assert group_bandwidth(CLUSTER, rail) == pytest.approx(50e9)
    assert group_bandwidth(CLUSTER, place_group(8, 1, 8)) == pytest.approx(450e9)  # NVLink


def test_cross_node_latency_grows_with_log_of_nodes():
    one = group_latency(CLUSTER, "all_reduce", place_group(16, 1, 8))
    many = group_latency(CLUSTER, "all_reduce", place_group(4096, 1, 8))
    intra = 2 * 7 * CLUSTER.intra.latency
    assert one == pytest.approx(intra + 2 * 2 * math.ceil(math.log2(2)) * CLUSTER.inter.latency)
    assert many == pytest.approx(intra + 2 * 2 * math.ceil(math.log2(512)) * CLUSTER.inter.latency)


def test_point_to_point_across_nodes_uses_one_gpus_share():
    nbytes = 1e8
    assert p2p_time(CLUSTER, nbytes, True) == pytest.approx(nbytes / 50e9 + CLUSTER.inter.latency)
    assert p2p_time(CLUSTER, nbytes, False) == pytest.approx(nbytes / 450e9 + CLUSTER.intra.latency)
