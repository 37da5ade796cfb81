"""Following a run directory: only what was appended, complete lines, a trimmed file."""

from __future__ import annotations

from meshyard.doctor.dashboard.run_source import RunDirSource
from meshyard.metrics.records import truncate_metrics
from meshyard.run_dir import RunDir
from tests.doctor.dashboard.records import append_records, make_run


def test_each_poll_gets_only_the_records_appended_since_its_offset(tmp_path):
    source = RunDirSource(make_run(tmp_path / "run", range(1, 4)))
    first = source.since(0)
    assert [r["step"] for r in first["records"]] == [1, 2, 3] and not first["reset"]
    assert "ranks" not in first["records"][0] and first["records"][0]["mfu"] == 0.31  # cut to the figures' keys
    assert [(e["kind"], e["step"]) for e in first["events"]] == [("restart", 2), ("guard", 3)]
    assert first["events"][0]["text"] == "restart 1: from step 2, 1 step(s) redone, 4.5 s to resume"
    assert source.since(first["offset"])["records"] == []
    append_records(tmp_path / "run", range(4, 6))
    later = source.since(first["offset"])
    assert [r["step"] for r in later["records"]] == [4, 5] and not later["finished"]


def test_a_trimmed_file_starts_over_and_a_line_being_written_waits(tmp_path):
    run_dir = make_run(tmp_path / "run", range(1, 5))
    source = RunDirSource(run_dir)
    offset = source.since(0)["offset"]
    truncate_metrics(run_dir, 2)  # a resume from step 2 drops steps 3-4, which it redoes
    again = source.since(offset)
    assert again["reset"] and [r["step"] for r in again["records"]] == [1, 2]
    with RunDir(run_dir).metrics.open("a") as handle:
        handle.write('{"step": 3, "lo')  # half a line
    waiting = source.since(again["offset"])
    assert waiting["records"] == [] and waiting["offset"] == again["offset"] and not waiting["reset"]


def test_a_run_that_has_not_recorded_yet_has_no_records(tmp_path):
    (tmp_path / "new").mkdir()
    payload = RunDirSource(tmp_path / "new").since(0)
    assert payload["records"] == [] and payload["offset"] == 0 and payload["events"] == []
