"""The [run] keys of a job on several nodes: each one's check, how values of another type
are read, and the parsers of node counts and endpoints."""

from __future__ import annotations

import pytest

from meshyard.config.checks import DEFAULT_RDZV_PORT, field_problems, node_range, split_endpoint
from meshyard.config.load import load_config

ENDPOINT = "--run.rdzv_endpoint=10.0.0.1:29400"


def _problems(*overrides: str) -> list[str]:
    return field_problems(load_config(None, list(overrides)))


@pytest.mark.parametrize("nnodes", ["0", "3:2", "x", "0:2", "-1", ":2"])
def test_a_node_count_that_is_neither_n_nor_min_max_is_refused(nnodes):
    [problem] = _problems(f"--run.nnodes={nnodes}", ENDPOINT)
    assert f"run.nnodes = '{nnodes}'" in problem
    assert "a node count ('2')" in problem and "'MIN:MAX' ('1:4')" in problem  # the forms to write instead


def test_a_range_without_its_maximum_is_refused():
    """KNOWN BUG (config/checks.py node_range): '2:' reads as '2' because an empty upper
    bound falls back to the lower one; a user who meant an elastic range gets a fixed one."""
    assert node_range("2:") is None
    [problem] = _problems("--run.nnodes=2:", ENDPOINT)
    assert "run.nnodes = '2:'" in problem


@pytest.mark.parametrize("endpoint", ["host:99999", "host:0", ":29400", "host:port"])
def test_a_malformed_endpoint_or_port_is_refused(endpoint):
    [problem] = _problems("--run.nnodes=2", f"--run.rdzv_endpoint={endpoint}")
    assert f"run.rdzv_endpoint = '{endpoint}' is not HOST[:PORT]" in problem
    assert "1-65535" in problem and "10.0.0.1:29400" in problem


def test_an_endpoint_with_stray_colons_is_refused():
    """KNOWN BUG (config/checks.py split_endpoint): a host with more than one colon and no
    brackets is taken whole as the host ('a:b:c' -> host 'a:b:c', port 29400), so the
    typo passes the check and fails only when the node tries to resolve it."""
    with pytest.raises(ValueError):
        split_endpoint("a:b:c")
    [problem] = _problems("--run.nnodes=2", "--run.rdzv_endpoint=a:b:c")
    assert "run.rdzv_endpoint = 'a:b:c'" in problem


@pytest.mark.parametrize("endpoint", ["[::1]:29400", "10.0.0.1:29400", "node-0", "[fd00::1]"])
def test_well_formed_endpoints_pass(endpoint):
    assert _problems("--run.nnodes=2", f"--run.rdzv_endpoint={endpoint}") == []


def test_node_rank_cannot_fix_the_ranks_of_an_elastic_range():
    [problem] = _problems("--run.nnodes=1:3", "--run.node_rank=0", ENDPOINT)
    assert "run.node_rank = 0" in problem and "run.nnodes = '1:3'" in problem
    assert "leave run.node_rank at -1" in problem


@pytest.mark.parametrize("rank, nnodes", [(2, "2"), (5, "3")])
def test_node_rank_must_be_below_the_node_count(rank, nnodes):
    [problem] = _problems(f"--run.nnodes={nnodes}", f"--run.node_rank={rank}", ENDPOINT)
    assert f"run.node_rank = {rank} must be below run.nnodes = {nnodes}" in problem


def test_node_rank_within_a_fixed_count_passes():
    assert _problems("--run.nnodes=2", "--run.node_rank=1", ENDPOINT) == []


@pytest.mark.parametrize("nnodes", ["2", "1:2"])
def test_several_nodes_need_an_endpoint(nnodes):
    [problem] = _problems(f"--run.nnodes={nnodes}")
    assert f"run.nnodes = '{nnodes}' needs run.rdzv_endpoint" in problem and "--rdzv-endpoint HOST:PORT" in problem


def test_one_node_needs_no_endpoint():
    assert _problems("--run.nnodes=1") == [] and _problems("--run.nnodes=1:1") == []


@pytest.mark.parametrize("key, value, fragment", [
    ("rdzv_timeout_s", "0", "run.rdzv_timeout_s = 0.0 must be"),
    ("rdzv_timeout_s", "-5", "run.rdzv_timeout_s = -5.0 must be"),
    # torch takes the wait in whole seconds: half a second would be none.
    ("rdzv_timeout_s", "0.5", "run.rdzv_timeout_s = 0.5 must be at least 1"),
    ("rdzv_last_call_s", "-1", "run.rdzv_last_call_s = -1.0 must not be negative"),
])
def test_rendezvous_waits_are_checked(key, value, fragment):
    [problem] = _problems(f"--run.{key}={value}")
    assert fragment in problem


def test_a_wait_of_one_second_passes():
    assert _problems("--run.rdzv_timeout_s=1", "--run.rdzv_last_call_s=0") == []


def test_problems_of_several_node_keys_are_listed_together():
    text = "\n".join(_problems("--run.nnodes=2", "--run.node_rank=4", "--run.rdzv_timeout_s=0"))
    assert "needs run.rdzv_endpoint" in text and "run.node_rank = 4" in text and "run.rdzv_timeout_s" in text


def test_a_whole_number_in_toml_or_on_the_command_line_is_read_as_its_digits(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[run]\nnnodes = 2\nrdzv_endpoint = '10.0.0.1'\nrdzv_id = 7\n")
    config = load_config(path)
    assert config.run.nnodes == "2" and config.run.rdzv_id == "7"
    assert field_problems(config) == []
    assert load_config(None, ["--run.rdzv_id=123"]).run.rdzv_id == "123"
    assert load_config(None, ["--run.nnodes=3"]).run.nnodes == "3"


@pytest.mark.parametrize("value", ["true", "1.5"])
def test_a_boolean_or_fraction_is_not_a_node_count(value):
    with pytest.raises(ValueError, match=r"run\.nnodes = (True|1\.5) should be str"):
        load_config(None, [f"--run.nnodes={value}"])


@pytest.mark.parametrize("text, bounds", [("1", (1, 1)), ("4", (4, 4)), ("1:4", (1, 4)), (" 2:3 ", (2, 3)),
                                          ("3:3", (3, 3))])
def test_node_range_reads_a_count_or_a_range(text, bounds):
    assert node_range(text) == bounds


@pytest.mark.parametrize("text", ["", "0", "0:0", "3:2", "x", "1:x", "1:2:3", "-2:2"])
def test_node_range_refuses_anything_else(text):
    assert node_range(text) is None


@pytest.mark.parametrize("text, parts", [
    ("10.0.0.1:29500", ("10.0.0.1", 29500)),
    ("node-0", ("node-0", DEFAULT_RDZV_PORT)),
    ("[::1]:29400", ("::1", 29400)),
    ("[fd00::2]", ("fd00::2", DEFAULT_RDZV_PORT)),
    ("fd00::2", ("fd00::2", DEFAULT_RDZV_PORT)),  # an IPv6 address without brackets has no port
    (" host:1 ", ("host", 1)),
    ("host:65535", ("host", 65535)),
])
def test_split_endpoint_gives_host_and_port(text, parts):
    assert split_endpoint(text) == parts


@pytest.mark.parametrize("text", ["", "host:65536", "host:0", "host:-1", ":1", "[]:1", "host:x"])
def test_split_endpoint_refuses_malformed_ones(text):
    with pytest.raises(ValueError):
        split_endpoint(text)
