"""Verdicts from synthetic records (each rule in isolation), the report page, the CLI."""

from __future__ import annotations

import json
import re

import pytest

from meshyard.cli import main
from meshyard.doctor.diagnose import diagnose
from meshyard.doctor.report import write_report


def fake_run(tmp_path, data=0.05, forward=0.3, backward=0.45, comm=0.1, optimizer=0.1, mfu=0.5, memory=0.3,
             busy=(0.1, 0.1), stragglers=(), straggler_hosts=None, hosts=None, idle_from=None):
    """40 steps of 0.1 s split by the given shares; with ``idle_from``, GPU utilisation
    readings of 90% before that step and 10% from it on."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    capacity = 80 * 2**30
    facts = {"world_size": 2, "memory_capacity_bytes": capacity, "local_world_size": 1, "grad_accum": 1}
    (tmp_path / "run.json").write_text(json.dumps({**facts, **({"hosts": hosts} if hosts else {})}))
    lines = []
    for step in range(1, 41):
        record = {"step": step, "loss": 3.0, "lr": 1e-3, "step_time_s": 0.1, "tokens_per_s": 1000.0,
                  "data_s": 0.1 * data, "forward_s": 0.1 * forward, "backward_s": 0.1 * backward,
                  "comm_s": 0.1 * comm, "optimizer_s": 0.1 * optimizer, "other_s": 0.0, "mfu": mfu,
                  "gpu_peak_reserved_bytes": memory * capacity}
        if idle_from is not None:
            record["gpu_utilization_pct"] = 10.0 if step >= idle_from else 90.0
        if step % 10 == 0:
            record["ranks"] = {"busy_s": list(busy), "step_time_s": [0.1, 0.1]}
            record["stragglers"] = list(stragglers)
            if straggler_hosts is not None:
                record["straggler_hosts"] = list(straggler_hosts)
            record["eval_loss"] = 3.1
        lines.append(json.dumps(record))
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


@pytest.mark.parametrize(
    "figures, verdict, advice_key",
    [
        ({}, "healthy", "train.micro_batch"),
        ({"data": 0.3, "forward": 0.2}, "data-bound", "data.num_workers"),
        ({"comm": 0.4, "backward": 0.2}, "communication-bound", "comm.compression"),
        ({"memory": 0.95}, "memory-bound", "parallel.ac"),
        ({"mfu": 0.12}, "compute-bound", "precision.dtype"),
        ({"busy": (0.1, 0.2), "stragglers": (1,)}, "straggler", "rank 1"),
    ],
)
def test_verdicts(tmp_path, figures, verdict, advice_key):
    diagnosis = diagnose(fake_run(tmp_path, **figures))
    assert diagnosis.verdict == verdict
    assert any(advice_key in line for line in diagnosis.findings[0].advice + diagnosis.findings[0].evidence)


def test_straggler_comes_first_and_secondary_findings_stay(tmp_path):
    diagnosis = diagnose(fake_run(tmp_path, comm=0.4, backward=0.2, busy=(0.1, 0.2), stragglers=(1,)))
    assert [f.verdict for f in diagnosis.findings] == ["straggler", "communication-bound"]


def test_straggler_is_named_with_its_host(tmp_path):
    """Hosts of one job may share a hostname: the address tells them apart."""
    hosts = ["node (10.0.0.1)", "node (10.0.0.2)"]
    run_dir = fake_run(tmp_path / "run", busy=(0.1, 0.2), stragglers=(1,), straggler_hosts=hosts[1:], hosts=hosts)
    finding = diagnose(run_dir).findings[0]
    assert finding.evidence[0].startswith("rank 1 on node (10.0.0.2) was the slowest in 4 of 4 gathered windows")
    assert finding.advice[0].startswith("check node (10.0.0.2), the host of rank 1, and its device: ")
    page = write_report(run_dir, tmp_path / "page.html").read_text()
    assert "rank 1 on node (10.0.0.2) was the slowest" in page
    # Records from before hosts were recorded name the rank alone.
    finding = diagnose(fake_run(tmp_path / "old", busy=(0.1, 0.2), stragglers=(1,))).findings[0]
    assert finding.evidence[0].startswith("rank 1 was the slowest")
    assert finding.advice[0].startswith("check the host and device of rank 1: ")


def test_report_is_self_contained_html(tmp_path):
    out = write_report(fake_run(tmp_path / "run"), tmp_path / "page.html")
    page = out.read_text()
    assert page.startswith("<!doctype html>") and "healthy" in page
    assert len(re.findall(r'src="data:image/png;base64,[A-Za-z0-9+/=]{200,}"', page)) == 5
    assert "http://" not in page and "https://" not in page  # nothing fetched when opened


def test_cli(tmp_path, capsys):
    run_dir = fake_run(tmp_path / "run", data=0.3, forward=0.2)
    assert main(["doctor", str(run_dir)]) == 0
    assert "verdict: data-bound" in capsys.readouterr().out
    assert main(["doctor", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "data-bound"
    assert main(["report", str(run_dir)]) == 0 and (run_dir / "report.html").exists()
    assert main(["doctor", str(tmp_path / "nothing")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


def test_doctor_names_each_waste_with_its_share_of_paid_time(tmp_path, capsys):
    """Steps 5-40 are judged (the first tenth is start-up): 24 of their 36 steps are idle."""
    run_dir = fake_run(tmp_path / "run", data=0.3, forward=0.2, comm=0.1, idle_from=17)
    assert main(["doctor", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "waste (share of paid time: 3.6 s of step time over 36 steady steps)" in out
    assert re.search(r"idle GPU +67%  \(2\.4 s\)  over its threshold", out), out
    assert re.search(r"data stall +30%  \(1\.1 s\)  over its threshold", out), out
    assert re.search(r"exposed comm +10%  \(0\.4 s\)\n", out), out
    assert main(["doctor", str(run_dir), "--json"]) == 0
    waste = {w["kind"]: w for w in json.loads(capsys.readouterr().out)["waste"]}
    assert waste["idle GPU"]["fraction"] == pytest.approx(24 / 36)
    assert waste["data stall"]["fraction"] == pytest.approx(0.3) and waste["data stall"]["flagged"]
    assert waste["exposed comm"]["fraction"] == pytest.approx(0.1) and not waste["exposed comm"]["flagged"]


def test_a_cpu_run_has_no_idle_gpu_figure(tmp_path):
    kinds = [w.kind for w in diagnose(fake_run(tmp_path / "run")).waste]
    assert kinds == ["data stall", "exposed comm"]


def _with_expert_load(run, per_layer: list[list[int]], dropped: int = 0):
    """``run``'s records with a MoE model's expert load added to every step."""
    path = run / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    imbalance = max(max(c) / (sum(c) / len(c)) for c in per_layer)
    path.write_text("".join(json.dumps({**r, "moe_tokens_per_expert": per_layer, "moe_dropped_tokens": dropped,
                                        "moe_imbalance": imbalance, "moe_aux_loss": 1.1, "moe_z_loss": 2.0}) + "\n"
                            for r in records))
    return run


def test_an_imbalanced_expert_load_is_named(tmp_path):
    diagnosis = diagnose(_with_expert_load(fake_run(tmp_path), [[10, 10, 10, 10], [40, 4, 4, 4]], dropped=20))
    assert diagnosis.verdict == "expert-imbalance"
    finding = diagnosis.findings[0]
    assert "3.08x the mean" in finding.evidence[0]
    assert "layer 1's experts took [40, 4, 4, 4] tokens (expert 0 the most)" in finding.evidence[1]
    assert "dropped 22% of the token assignments" in finding.evidence[2]
    assert any("model.moe_aux_loss_weight" in line for line in finding.advice)
    assert any("model.moe_capacity_factor" in line for line in finding.advice)


def test_a_balanced_expert_load_is_not_named(tmp_path):
    diagnosis = diagnose(_with_expert_load(fake_run(tmp_path), [[10, 11, 9, 10], [12, 8, 10, 10]]))
    assert diagnosis.verdict == "healthy"


def _with_collector(run, pauses: dict[int, float]):
    """The records of ``run`` with ``gc_s`` at the given steps."""
    path = run / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        if record["step"] in pauses:
            record["gc_s"] = pauses[record["step"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


@pytest.mark.parametrize("pauses, named", [
    ({step: 0.001 for step in range(5, 41)}, False),  # 1% of each 0.1 s step
    ({step: 0.008 for step in range(5, 41)}, True),  # 8% of the steps' time
    ({20: 0.25}, True),  # one pause of two and a half steps
    ({1: 5.0}, False),  # start-up: the first step's freeze is not a steady step
])
def test_garbage_collection_pauses_are_named(tmp_path, pauses, named):
    diagnosis = diagnose(_with_collector(fake_run(tmp_path), pauses))
    found = [f for f in diagnosis.findings if f.verdict == "gc-pauses"]
    assert bool(found) is named
    if named:
        assert diagnosis.verdict == "gc-pauses"  # the run is healthy otherwise
        assert "garbage collector ran" in found[0].evidence[0] and "longest pause" in found[0].evidence[1]
        assert any("NumPy arrays" in line for line in found[0].advice)
        assert any("data.num_workers" in line for line in found[0].advice)


@pytest.mark.parametrize("config, advised", [
    ("", True),  # meshyard's GPT (the default model) on one whole head
    ('[train]\nfused_linear_loss = true\n', False),  # already on
    ('[parallel]\ntp = 2\n', False),  # a vocabulary-split head
    ('[model]\nname = "mlp"\n', False),  # logits only
])
def test_a_memory_bound_run_is_advised_the_fused_loss_where_it_can_take_it(tmp_path, config, advised):
    run_dir = fake_run(tmp_path, memory=0.95)
    (run_dir / "config.toml").write_text(config)
    [finding] = [f for f in diagnose(run_dir).findings if f.verdict == "memory-bound"]
    assert any("train.fused_linear_loss = true" in line for line in finding.advice) == advised
