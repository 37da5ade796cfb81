"""``meshyard verify`` on mixture-of-experts layouts: expert parallelism trains the model one
process trains, with ep = 4 (each rank holds one expert; dropping tokens over capacity,
with a shared expert), ep = 2 x FSDP (experts split over pairs of ranks and sharded
over the pairs), ep = 2 x tp = 2 (attention and the shared expert split over tp pairs,
the routed experts over the two data-parallel ranks of each tp index), ep = 2 under HSDP
(two replicas of an ep pair: each expert's shard dimension has one rank, its gradient goes
through the replicas' all-reduce) and ep = 2 accumulating two micro-batches per rank
(expert gradients kept unsynchronised over the first, under a capacity limit) on four ranks.

Each case is what the command runs: the one-process run (here in the test process) and the
layout run (in the session's shared spawn of its world size), compared by the command's
own ``compare_runs``. Every rank routes its own micro-batch, as the one process routes each
of its accumulated micro-batches, so routing, router losses and dropped tokens are the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshyard.config.sections import Config
from meshyard.metrics.records import read_metrics
from meshyard.metrics.schema import validate_record
from meshyard.validate import load_and_validate
from meshyard.verify import VerifyReport, tolerance_for
from meshyard.verify.compare import _for_comparison, compare_runs, describe_layout, single_process
from tests import shared_spawn
from tests.inprocess import fit_each_with_facts, fit_here

STEPS = 2
TINY_MOE = ["--model.name=gpt-tiny", "--data.source=random", "--data.seq_len=16", "--data.random_tokens=20000",
            "--train.global_batch=8", "--optim.warmup_steps=2", "--metrics.progress_bar=false", "--metrics.mfu=false",
            "--model.moe_experts=4", "--model.moe_top_k=2", "--parallel.strategy=fsdp"]
CASES = {  # name: (ranks, overrides)
    "ep4-capacity-shared": (4, ["--parallel.ep=4", "--model.moe_capacity_factor=1.0",
                                "--model.moe_shared_experts=1"]),
    "ep2-fsdp4": (4, ["--parallel.ep=2"]),
    "ep2-tp2": (4, ["--parallel.ep=2", "--parallel.tp=2", "--model.moe_shared_experts=1"]),
    "ep2-hsdp2": (4, ["--parallel.ep=2", "--parallel.dp_replicate=2"]),
    "ep2-fsdp4-accumulate": (4, ["--parallel.ep=2", "--train.micro_batch=1", "--model.moe_capacity_factor=1.0"]),
}


def _configs(folder: Path, case: str) -> tuple[Config, Config, VerifyReport]:
    """The one-process and layout configs ``meshyard verify`` makes of the case, and its
    empty report."""
    ranks, overrides = CASES[case]
    config, checked = load_and_validate(None, [*TINY_MOE, *overrides, f"--run.nproc={ranks}",
                                               f"--data.cache_dir={folder / 'cache'}"])
    precision, tolerance = tolerance_for(config.run, config.precision)
    report = VerifyReport(precision, tolerance, describe_layout(config.parallel, ranks, checked.dims))
    single = _for_comparison(single_process(config, checked.batch.micro_batch), STEPS, folder / case / "single")
    return single, _for_comparison(config, STEPS, folder / case / "layout"), report


def _layout_job(ranks: int) -> shared_spawn.JobMaker:
    def make(request: pytest.FixtureRequest, folder: Path) -> tuple:
        cases = [case for case, (size, _) in CASES.items() if size == ranks]
        return fit_each_with_facts, ([_configs(folder, case)[1] for case in cases],)
    return make


shared_spawn.register(4, "verify: moe on 4 ranks", __name__, _layout_job(4))


@pytest.fixture(scope="module")
def moe_reports(request) -> dict[str, VerifyReport]:
    reports = {}
    for case, (ranks, _) in CASES.items():
        folder, _ = shared_spawn.result(request, ranks, f"verify: moe on {ranks} ranks")
        single, _, report = _configs(folder, case)
        fit_here(single)
        report.run_dirs = (str(folder / case / "single"), str(folder / case / "layout"))
        reports[case] = compare_runs(folder / case / "single", folder / case / "layout", report)
    return reports


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_layouts_pass(moe_reports, case):
    report = moe_reports[case]
    assert report.passed and not report.missing, report.format()
    assert len(report.steps) == STEPS and f"ep {CASES[case][1][0].split('=')[1]}" in report.layout


def test_layout_records_carry_the_expert_load(moe_reports):
    """The routed load is recorded per step under the schema, rank 0's: its micro-batch's
    tokens x top_k per layer; with a capacity limit some of them are dropped."""
    layout = read_metrics(moe_reports["ep4-capacity-shared"].run_dirs[1])
    for record in layout:
        assert validate_record(record) == [], record
        per_layer = record["moe_tokens_per_expert"]
        assert len(per_layer) == 2 and all(sum(counts) == 2 * 16 * 2 for counts in per_layer)
        assert record["moe_imbalance"] >= 1.0 and record["moe_aux_loss"] > 0 and record["moe_z_loss"] > 0
    assert sum(r["moe_dropped_tokens"] for r in layout) > 0
