"""``meshyard dashboard``'s command line: a snapshot, and bad input told in one paragraph."""

from __future__ import annotations

import json

import pytest

from meshyard.cli import main
from tests.doctor.dashboard.records import make_run


def test_write_makes_a_snapshot_page_with_the_records(tmp_path, capsys):
    run_dir = make_run(tmp_path / "run", range(1, 4))
    out = tmp_path / "snapshot.html"
    assert main(["dashboard", str(run_dir), "--write", str(out)]) == 0
    assert f"snapshot written to {out}" in capsys.readouterr().out
    page = out.read_text()
    config = json.loads(page.split("id='dashboard-config'>")[1].split("</script>")[0])
    assert config["poll_ms"] == 0 and [r["step"] for r in config["payload"]["records"]] == [1, 2, 3]
    assert [f["name"] for f in config["figures"]] == ["loss", "throughput", "mfu", "breakdown", "memory",
                                                      "gpu_utilization", "cost"]
    assert "<script src" not in page  # self-contained


@pytest.mark.parametrize("argv, fragment", [
    ([], "no run to show; give RUN_DIR"),
    (["/no/such/run"], "RUN_DIR '/no/such/run' is not a directory"),
    (["RUN", "--prometheus", "http://p:9090"], "drop RUN_DIR to read Prometheus"),
    (["--prometheus", "p:9090"], "is not an HTTP address"),
    (["--prometheus", "http://p:9090", "--match", "job=x"], "is not a label selector"),
    (["--prometheus", "http://p:9090", "--range", "soon"], "is not a duration"),
    (["RUN", "--poll-ms", "5"], "--poll-ms 5 is too short"),
    (["RUN", "--port", "-1"], "--port -1 is not a port"),
])
def test_bad_input_exits_2_with_one_message(argv, fragment, tmp_path, capsys):
    run_dir = make_run(tmp_path / "run", range(1, 2))
    assert main(["dashboard", *[str(run_dir) if a == "RUN" else a for a in argv]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshyard dashboard: ") and fragment in err and "Traceback" not in err
