"""Topology-aware placement: which nodes, in which order, what it saves, and every refusal."""

from __future__ import annotations

import json
import random
from itertools import combinations

import pytest

from meshyard.cli import main
from meshyard.plan.inventory import DEFAULT_LINK_PER_GPU, InventoryError, load_inventory, parse_inventory, parse_rate
from meshyard.plan.place_cost import estimate_comm, plan_inputs
from meshyard.plan.placement import (
    PlacementError, fewest_nodes, group_spans, hostfile, node_affinity, nodelist, place, round_robin,
)
from meshyard.plan.cost import estimate_step
from meshyard.plan.hardware import make_cluster
from meshyard.plan.layout import PRECISIONS, PlannedLayout
from meshyard.models.gpt import GPT_PRESETS, GPTShape
from meshyard.plan.model import describe_gpt

LEAF_BW, SPINE_BW = 50e9, 12.5e9


def inventory(nodes, levels=("spine", "leaf"), bandwidth=None, **top):
    """An inventory from (name, free_gpus, domains) triples, 80 GB GPUs unless a 4th item says."""
    data = {"levels": list(levels), **top,
            "nodes": [{"name": n[0], "free_gpus": n[1], "domains": list(n[2]),
                       "gpu_memory_gb": n[3] if len(n) > 3 else 80} for n in nodes]}
    if bandwidth is not None:
        data["bandwidth"] = bandwidth
    return parse_inventory(data, "test inventory")


def taken(placement):
    return [(node.name, gpus) for node, gpus in zip(placement.nodes, placement.counts)]


TWO_LEAVES = [("a1", 8, ("s1", "l1")), ("a2", 4, ("s1", "l1")),
              ("b1", 8, ("s1", "l2")), ("b2", 8, ("s1", "l2")),
              ("c1", 8, ("s2", "l3"))]
BANDWIDTH = {"leaf": "400Gb/s", "spine": "100Gb/s"}


# --- choosing nodes -------------------------------------------------------------------------------

def test_kueue_example_takes_three_three_and_one():
    """Kueue's topology-aware scheduling example: free 3, 3, 2, 1 in one domain, 7 GPUs ->
    3 + 3 + 1, leaving the node with 2 free whole."""
    inv = inventory([("n1", 3, ("b1",)), ("n2", 3, ("b1",)), ("n3", 2, ("b1",)), ("n4", 1, ("b1",))],
                    levels=("block",))
    placement = place(inv, 7)
    assert sorted(g for _, g in taken(placement)) == [1, 3, 3]
    assert {name for name, _ in taken(placement)} == {"n1", "n2", "n4"}
    assert placement.gpus == 7 and placement.domain == ("b1",)


def test_one_node_when_it_fits_the_tightest_one():
    inv = inventory([("big", 8, ("s1", "l1")), ("half", 4, ("s1", "l1")), ("six", 6, ("s1", "l2"))])
    assert taken(place(inv, 4)) == [("half", 4)]
    assert taken(place(inv, 5)) == [("six", 5)]
    assert taken(place(inv, 8)) == [("big", 8)]
    assert len(place(inv, 5).nodes) == 1 and place(inv, 5).ranks == (0,) * 5


def test_narrowest_domain_wins_across_two_leaves():
    inv = inventory(TWO_LEAVES, bandwidth=BANDWIDTH)
    # leaf l1 holds 12 exactly; 16 fit only in leaf l2 (listed later); 20 need the spine.
    assert taken(place(inv, 12)) == [("a1", 8), ("a2", 4)]
    sixteen = place(inv, 16)
    assert taken(sixteen) == [("b1", 8), ("b2", 8)] and sixteen.domain == ("s1", "l2")
    twenty = place(inv, 20)
    assert twenty.domain == ("s1",) and sorted(g for _, g in taken(twenty)) == [4, 8, 8]
    # The whole spine s1 (28) cannot hold 30: the job spans spines.
    assert place(inv, 30).domain == ()


def test_inside_a_domain_fewest_nodes_then_exact_fill_then_small_nodes():
    assert fewest_nodes([4, 3, 3], 6) == {3: 2}  # 3 + 3 fills exactly; 4 stays whole
    assert fewest_nodes([5, 3, 4, 4], 8) == {4: 2}  # 4 + 4 keeps the 5 whole, not 5 + 3
    assert fewest_nodes([8, 1, 1, 1, 1], 4) == {8: 1}  # one node before four
    assert fewest_nodes([2, 2], 5) is None


def test_fewest_nodes_matches_brute_force():
    rng = random.Random(7)
    for _ in range(150):
        caps = [rng.choice([1, 2, 3, 4, 6, 8]) for _ in range(rng.randint(1, 8))]
        need = rng.randint(1, sum(caps))
        best = min((len(c), sum(c) - need, sorted(c, reverse=True))
                   for k in range(1, len(caps) + 1) for c in combinations(caps, k) if sum(c) >= need)
        counts = fewest_nodes(caps, need)
        assert (sum(counts.values()), sum(s * n for s, n in counts.items()) - need,
                sorted(counts.elements(), reverse=True)) == best, (caps, need)


def test_tensor_parallel_group_never_spans_nodes():
    inv = inventory([("n1", 3, ("b",)), ("n2", 3, ("b",)), ("n3", 2, ("b",)), ("n4", 1, ("b",))],
                    levels=("block",))
    placement = place(inv, 6, tp=2)
    assert all(g % 2 == 0 for g in placement.counts) and placement.gpus == 6
    spans = group_spans(placement, dp_replicate=3, dp_shard=1, tp=2, pp=1)
    assert all(not span.crosses_nodes for span in spans["tp"])
    assert {span.nodes for span in spans["dp"]} == {3}


def test_pipeline_neighbours_sit_on_nodes_of_one_leaf_before_the_next():
    # Listed alternating between the leaves; ranks must still go leaf by leaf.
    inv = inventory([("x1", 8, ("s1", "l1")), ("y1", 8, ("s1", "l2")),
                     ("x2", 8, ("s1", "l1")), ("y2", 8, ("s1", "l2"))], bandwidth=BANDWIDTH)
    placement = place(inv, 32)
    assert [n.domains[1] for n in placement.nodes] == ["l1", "l1", "l2", "l2"]
    pairs = group_spans(placement, dp_replicate=1, dp_shard=1, tp=8, pp=4)["pp"]
    # Stages 0-1 and 2-3 share a leaf; only the boundary 1-2 goes through the spine.
    assert sorted(span.shared for span in pairs) == [1, 2]


def test_equal_counts_per_node_when_asked():
    inv = inventory(TWO_LEAVES)
    placement = place(inv, 16, per_node=4)
    assert placement.counts == (4, 4, 4, 4) and placement.domain == ("s1",)
    assert "a2" in nodelist(placement).split(",")  # the node with exactly 4 free is filled first


def test_round_robin_takes_one_gpu_per_node_in_turn():
    naive = round_robin(inventory(TWO_LEAVES), 7)
    assert [naive.nodes[i].name for i in naive.ranks] == ["a1", "a2", "b1", "b2", "c1", "a1", "a2"]
    assert naive.domain == ()


# --- the cost model's verdict ---------------------------------------------------------------------

def _gpt_small() -> tuple:
    shape = GPTShape(vocab_size=50257, context_length=1024, **GPT_PRESETS["gpt-small"])
    return describe_gpt(shape)


def test_one_node_costs_what_the_planner_says_for_one_node():
    inv = inventory([("n1", 8, ("s1", "l1"))], bandwidth=BANDWIDTH)
    desc = _gpt_small()
    layout = PlannedLayout(strategy="ddp", dp_replicate=4, tp=2, seq_len=1024, micro_batch=4)
    comm = estimate_comm(inv, place(inv, 8, tp=2), desc, layout)
    step = estimate_step(desc, layout, make_cluster("h100", n_gpus=8, gpus_per_node=8))
    assert comm.seconds["tp"] == pytest.approx(step.seconds("tp comm"))
    assert comm.seconds["dp"] == pytest.approx(step.seconds("dp comm (exposed)"))
    assert comm.seconds["pp"] == 0.0 and comm.seconds["tp"] > 0


def test_uniform_nodes_cost_what_the_planner_says_for_that_cluster():
    """Two full 8-GPU nodes under one leaf are the planner's own cluster: 8 GPUs per node,
    8 x 50 GB/s per node. Every kind of group costs what the planner says there."""
    inv = inventory([("n1", 8, ("s1", "l1")), ("n2", 8, ("s1", "l1"))], bandwidth=BANDWIDTH)
    desc = _gpt_small()
    cluster = make_cluster("h100", n_gpus=16, gpus_per_node=8, inter_bandwidth=8 * LEAF_BW)
    for layout in (PlannedLayout(strategy="none", tp=8, pp=2, micro_batch=2, grad_accum=4, seq_len=1024),
                   PlannedLayout(strategy="fsdp3", dp_shard=8, tp=2, seq_len=1024, micro_batch=2),
                   PlannedLayout(strategy="hsdp", dp_replicate=2, dp_shard=8, seq_len=1024, micro_batch=2)):
        comm = estimate_comm(inv, place(inv, 16, tp=layout.tp), desc, layout)
        step = estimate_step(desc, layout, cluster)
        assert comm.seconds["tp"] == pytest.approx(step.seconds("tp comm")), layout.describe()
        assert comm.seconds["pp"] == pytest.approx(step.seconds("pp transfers")), layout.describe()
        assert comm.seconds["dp"] == pytest.approx(step.seconds("dp comm (exposed)")), layout.describe()
        assert comm.total == pytest.approx(step.exposed_comm)


def test_placement_beats_round_robin_with_the_cost_models_numbers():
    """Two nodes under one leaf, tp = 2: the placement keeps each tp pair on a node,
    round-robin splits every pair over the leaf; the planner prices both."""
    inv = inventory([("n1", 8, ("s1", "l1")), ("n2", 8, ("s1", "l1")), ("n3", 8, ("s2", "l9"))],
                    bandwidth=BANDWIDTH)
    desc = _gpt_small()
    layout = PlannedLayout(strategy="ddp", dp_replicate=8, tp=2, seq_len=1024, micro_batch=4,
                    precision=PRECISIONS["bf16"])
    placed, naive = place(inv, 16, tp=2), round_robin(inv, 16)
    assert taken(placed) == [("n1", 8), ("n2", 8)]
    ours, theirs = estimate_comm(inv, placed, desc, layout), estimate_comm(inv, naive, desc, layout)
    # Placed: tp inside a node, dp over 2 nodes of one leaf with 4 ranks of the group on each.
    inside = estimate_step(desc, layout, make_cluster("h100", n_gpus=16, gpus_per_node=16))
    assert ours.seconds["tp"] == pytest.approx(inside.seconds("tp comm"))
    over_leaf = estimate_step(desc, layout, make_cluster("h100", n_gpus=16, gpus_per_node=8,
                                                         inter_bandwidth=8 * LEAF_BW))
    assert ours.seconds["dp"] == pytest.approx(over_leaf.seconds("dp comm (exposed)"))
    # Round-robin: n1, n2, n3 in turn, so each tp pair crosses a node boundary, and n3
    # shares no domain with the others: the spine-level link, one rank per node.
    across = estimate_step(desc, layout, make_cluster("h100", n_gpus=16, gpus_per_node=1,
                                                      inter_bandwidth=SPINE_BW))
    assert theirs.seconds["tp"] == pytest.approx(across.seconds("tp comm"))
    assert ours.total < theirs.total and ours.seconds["tp"] < theirs.seconds["tp"] / 10
    assert ours.seconds["dp"] <= theirs.seconds["dp"]


def test_config_layout_reaches_the_planner(tmp_path):
    from meshyard.validate import load_and_validate

    cfg, checked = load_and_validate(None, ["--model.name=gpt-tiny", "--data.source=random", "--data.seq_len=32",
                                            "--parallel.strategy=fsdp", "--parallel.tp=2",
                                            "--train.global_batch=8"], world_size=8)
    desc, layout = plan_inputs(cfg, checked)
    assert (layout.strategy, layout.dp_shard, layout.tp, layout.pp) == ("fsdp3", 4, 2, 1)
    assert layout.micro_batch * layout.grad_accum * layout.dp == 8 and layout.seq_len == 32
    assert desc.n_layer == 2


# --- the command and its outputs ------------------------------------------------------------------

@pytest.fixture()
def inventory_file(tmp_path):
    path = tmp_path / "nodes.toml"
    path.write_text("""
levels = ["spine", "leaf"]
[bandwidth]
leaf = "400Gb/s"
spine = "100Gb/s"
[[nodes]]
name = "n1"
free_gpus = 3
gpu_memory_gb = 80
domains = ["s1", "l1"]
[[nodes]]
name = "n2"
free_gpus = 3
gpu_memory_gb = 80
domains = ["s1", "l1"]
[[nodes]]
name = "n3"
free_gpus = 2
gpu_memory_gb = 80
domains = ["s1", "l1"]
[[nodes]]
name = "n4"
free_gpus = 1
gpu_memory_gb = 80
domains = ["s1", "l1"]
""")
    return path


TINY = ["--model.name=gpt-tiny", "--data.source=random", "--data.seq_len=32", "--train.global_batch=14"]


def test_json_output(inventory_file, capsys):
    assert main(["place", "--nodes", str(inventory_file), "--gpus", "7", "--json", *TINY]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted((n["name"], n["gpus"]) for n in report["nodes"]) == [("n1", 3), ("n2", 3), ("n4", 1)]
    assert all(set(n) == {"name", "gpus"} for n in report["nodes"])
    assert report["domain"] == ["s1", "l1"] and report["layout"]["dp_replicate"] == 7
    comm = report["communication"]["seconds"]
    assert comm["total"] == pytest.approx(comm["tp"] + comm["pp"] + comm["dp"]) and comm["dp"] > 0
    assert report["round_robin"]["nodes"] == round_robin(load_inventory(inventory_file), 7).as_dict()["nodes"]
    assert report["communication"]["links"]["dp"].startswith("3 nodes (1-3 ranks on each) sharing a leaf")


def test_text_report_hostfile_and_nodelist(inventory_file, tmp_path, capsys):
    hosts = tmp_path / "hostfile"
    assert main(["place", "--nodes", str(inventory_file), "--gpus", "7", "--hostfile", str(hosts), *TINY]) == 0
    text = capsys.readouterr().out
    assert "Round-robin for comparison: n1 2, n2 2, n3 2, n4 1." in text
    assert "placed" in text and "round-robin" in text and "dp" in text
    assert sorted(hosts.read_text().splitlines()) == ["n1 slots=3", "n2 slots=3", "n4 slots=1"]
    assert main(["place", "--nodes", str(inventory_file), "--gpus", "7", "--format", "nodelist", *TINY]) == 0
    assert sorted(capsys.readouterr().out.strip().split(",")) == ["n1", "n2", "n4"]
    assert main(["place", "--nodes", str(inventory_file), "--gpus", "7", "--format", "hostfile", *TINY]) == 0
    assert capsys.readouterr().out == hosts.read_text()


def test_affinity_output_is_the_node_affinity(inventory_file, capsys):
    yaml = pytest.importorskip("yaml")
    assert main(["place", "--nodes", str(inventory_file), "--gpus", "6", "--format", "affinity", *TINY,
                 "--train.global_batch=12"]) == 0
    affinity = yaml.safe_load(capsys.readouterr().out)["affinity"]
    placement = place(load_inventory(inventory_file), 6)
    assert affinity == node_affinity(placement)
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["values"] == [n.name for n in placement.nodes]


def test_hostfile_and_nodelist_in_node_rank_order():
    placement = place(inventory(TWO_LEAVES), 20)
    assert hostfile(placement).splitlines() == [f"{n.name} slots={g}" for n, g in zip(placement.nodes,
                                                                                     placement.counts)]
    assert nodelist(placement) == ",".join(n.name for n in placement.nodes)


# --- refusals -------------------------------------------------------------------------------------

def _refusal(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshyard") and "Traceback" not in err
    assert err.strip().count("\n") == 0, "one paragraph"
    return err


def test_refuses_more_gpus_than_are_free_saying_where(inventory_file, capsys):
    err = _refusal(["place", "--nodes", str(inventory_file), "--gpus", "10", *TINY, "--train.global_batch=10"],
                   capsys)
    assert "needs 10 GPUs but only 9 are free" in err and "s1/l1: n1 3, n2 3, n3 2, n4 1" in err


def test_refuses_when_whole_tensor_groups_do_not_fit(inventory_file, capsys):
    err = _refusal(["place", "--nodes", str(inventory_file), "--gpus", "8", *TINY, "--train.global_batch=4",
                    "--parallel.tp=2"], capsys)
    assert "tensor-parallel groups of 2" in err and "make only 6" in err


def test_refuses_tp_larger_than_any_node(inventory_file, capsys):
    err = _refusal(["place", "--nodes", str(inventory_file), "--gpus", "4", *TINY, "--train.global_batch=1",
                    "--parallel.tp=4", "--model.name=gpt-mini"], capsys)
    assert "parallel.tp = 4" in err and "the most is 3, on n1" in err


def test_refuses_gpus_too_small_for_the_job(tmp_path, capsys):
    inv = inventory([("small", 8, ("b",), 16)], levels=("block",))
    with pytest.raises(PlacementError, match=r"needs 40 GB of memory per GPU .*\(the most is 16 GB, on small\)"):
        place(inv, 4, min_memory_gb=40)
    # Nodes too small are left out, and the shortage says so.
    inv = inventory([("small", 8, ("b",), 16), ("roomy", 2, ("b",), 80)], levels=("block",))
    with pytest.raises(PlacementError, match="only 10 are free .* small cannot take it"):
        place(inv, 4, min_memory_gb=40)
    # Through the command: the planner's estimate of the config's memory per GPU.
    path = tmp_path / "tiny.toml"
    path.write_text("[[nodes]]\nname = 'n1'\nfree_gpus = 8\ngpu_memory_gb = 0.001\n")
    err = _refusal(["place", "--nodes", str(path), "--gpus", "2", *TINY], capsys)
    assert "GB of memory per GPU" in err and "the most is 0.001 GB, on n1" in err


def test_refuses_unequal_share_that_does_not_divide():
    with pytest.raises(PlacementError, match="--gpus-per-node 3 must divide --gpus 8"):
        place(inventory(TWO_LEAVES), 8, per_node=3)
    with pytest.raises(PlacementError, match="needs 5 nodes with 8 free GPUs each"):
        place(inventory(TWO_LEAVES), 40, per_node=8)


@pytest.mark.parametrize("text, fragments", [
    ("[[nodes]]\nname = 'a'\nfree_gpus = 1\ngpu_memory_gb = 80\ndomains = ['s1', 'l1']\n"
     "[[nodes]]\nname = 'b'\nfree_gpus = 1\ngpu_memory_gb = 80\ndomains = ['s1']\n",
     ["different numbers of domains", "2 level(s): a", "1 level(s): b"]),
    ("[[nodes]]\nname = 'a'\nfree_gpus = -1\ngpu_memory_gb = 'lots'\ndomain = ['x']\n"
     "[[nodes]]\nname = 'a'\nfree_gpus = 2\ngpu_memory_gb = 80\n",
     ["4 problems", "free_gpus = -1", "gpu_memory_gb = 'lots'", "unknown key 'domain'"]),
    ("[[nodes]]\nname = 'a'\nfree_gpus = 1\ngpu_memory_gb = 80\n[[nodes]]\nname = 'a'\nfree_gpus = 1\n"
     "gpu_memory_gb = 80\n", ["'a' appears 2 times"]),
    ("gpu = 'h1000'\nlevels = ['leaf']\n[bandwidth]\nleaf = 'fast'\nspine = '1GB/s'\n[[nodes]]\nname = 'a'\n"
     "free_gpus = 1\ngpu_memory_gb = 80\ndomains = ['l1']\n",
     ["unknown GPU 'h1000'", "bandwidth.leaf: 'fast' is not a bandwidth", "bandwidth.spine: not a link"]),
    ("levels = ['spine', 'leaf']\n[[nodes]]\nname = 'a'\nfree_gpus = 1\ngpu_memory_gb = 80\ndomains = ['l1']\n",
     ["levels = ['spine', 'leaf'] must name each of the 1 domain level"]),
    ("nodes = 3\n", ["no [[nodes]] tables"]),
    ("[[nodes]\nname = 'a'\n", ["is not valid TOML"]),
])
def test_bad_inventory_is_one_paragraph_naming_every_problem(tmp_path, capsys, text, fragments):
    path = tmp_path / "nodes.toml"
    path.write_text(text)
    with pytest.raises(InventoryError) as info:
        load_inventory(path)
    for fragment in fragments:
        assert fragment in str(info.value)
    err = _refusal(["place", "--nodes", str(path), "--gpus", "1", *TINY, "--train.global_batch=1"], capsys)
    assert fragments[0] in err


def test_refuses_no_gpus(inventory_file, capsys):
    assert "--gpus 0 must be at least 1" in _refusal(["place", "--nodes", str(inventory_file), "--gpus", "0"], capsys)


def test_missing_inventory_is_refused(tmp_path, capsys):
    err = _refusal(["place", "--nodes", str(tmp_path / "none.toml"), "--gpus", "1", *TINY], capsys)
    assert "does not exist" in err and "--nodes" in err


def test_bad_config_is_refused_by_the_meshyard_command(inventory_file, capsys):
    assert main(["place", "--nodes", str(inventory_file), "--gpus", "7", *TINY, "--train.global_batch=8"]) == 2
    assert "not divisible by the data-parallel size 7" in capsys.readouterr().err


# --- the inventory's links ------------------------------------------------------------------------

def test_bandwidths_in_bits_bytes_and_defaults():
    assert parse_rate("400Gb/s") == 50e9 and parse_rate("50GB/s") == 50e9 and parse_rate(25) == 25e9
    assert parse_rate("800 Mbps") == 100e6
    with pytest.raises(ValueError):
        parse_rate("0GB/s")
    inv = inventory(TWO_LEAVES, bandwidth={"leaf": "400Gb/s", "node": "900GB/s"})
    # The spine was not given: it takes the leaf's; nodes sharing no domain take the spine's.
    assert inv.link(2) == ("leaf", 50e9) and inv.link(1) == ("spine", 50e9) and inv.link(0) == ("cluster", 50e9)
    assert inv.node_bandwidth == 900e9
    assert inventory(TWO_LEAVES).link(2)[1] == DEFAULT_LINK_PER_GPU


def test_example_inventory_loads_and_places():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "cluster" / "nodes.toml"
    inv = load_inventory(path)
    assert inv.levels == ("spine", "leaf") and inv.link(0)[1] == 12.5e9
    assert place(inv, 16).domain == ("spine-1", "leaf-2")
