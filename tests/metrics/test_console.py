"""The one-line step-time breakdown shown on rank 0's console."""

from __future__ import annotations

from meshyard.metrics.console import ProgressDisplay, breakdown


def test_breakdown_names_every_phase_in_order():
    record = {"step_time_s": 0.2, "data_s": 0.002, "forward_s": 0.06, "backward_s": 0.1, "comm_s": 0.03,
              "optimizer_s": 0.004, "mfu": 0.42}
    assert breakdown(record) == "data 1% fwd 30% bwd 50% comm 15% opt 2% mfu 42%"
    assert breakdown({"step_time_s": 0.2}) == ""  # measurement off


def test_notes_print_brackets_as_written(capsys):
    display = ProgressDisplay(total_steps=1, log_every=1, use_bar=False)
    display.note("meshyard: rank 1 failed: [/pair.cc:553] Connection closed by peer [bold]")
    assert "[/pair.cc:553] Connection closed by peer [bold]" in capsys.readouterr().out
