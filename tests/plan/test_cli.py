"""``meshyard plan`` from the command line: output, and one clear message for bad input."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from meshyard.plan.cli import build_parser, register, run
from meshyard.plan.inputs import strategies_from_args


def _run(*argv: str) -> int:
    return run(list(argv))


def test_ranked_table_rejections_and_arithmetic(capsys):
    code = _run("--model", "gpt2-124m", "--gpus", "16", "--gpu", "a100-40gb", "--interconnect", "ib-hdr-8x")
    out = capsys.readouterr().out
    assert code == 0
    assert "Feasible layouts, fastest first" in out and "Rejected layouts" in out
    assert "n_head=12 is not divisible by tp=8" in out
    assert "Memory of #1" in out and "K*Psi" in out and "Step time of #1" in out


def test_subcommand_wiring():
    parser = argparse.ArgumentParser(prog="meshyard")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--model", "gpt-tiny", "--gpus", "2", "--seq-len", "128", "--explain", "0"])
    assert args.command == "plan" and not args.takes_overrides and args.handler(args, []) == 0


def test_custom_size_and_memory_override(capsys):
    code = _run("--model", "gpt", "--n-layer", "32", "--n-head", "32", "--d-model", "4096", "--seq-len", "4096",
                "--gpus", "64", "--gpu", "h100", "--gpu-memory", "80GB", "--gpus-per-node", "8",
                "--interconnect", "ib-ndr-8x", "--top", "3", "--explain", "0")
    out = capsys.readouterr().out
    assert code == 0 and "6.667B parameters" in out and "80 GB" in out
    assert "ddp dp=64 tp=1 pp=1" in out and "out of memory" in out


def test_config_file_supplies_defaults(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[model]\nname = "gpt-mini"\n[data]\nseq_len = 256\n[train]\nglobal_batch = 64\n')
    assert _run("--config", str(cfg), "--gpus", "2", "--explain", "0") == 0
    out = capsys.readouterr().out
    assert "gpt-mini" in out and "vocab=256" in out and "Global batch 64 x 256 tokens" in out


def test_a_config_with_the_fused_loss_is_planned_with_it(tmp_path, capsys):
    """train.fused_linear_loss = true makes --fused-loss default to on: every layout runs it
    (tensor and pipeline parallel ones cannot), and the settings printed keep it."""
    cfg = tmp_path / "run.toml"
    cfg.write_text('[model]\nname = "gpt-mini"\n[data]\nseq_len = 256\n[train]\nglobal_batch = 64\n'
                   'fused_linear_loss = true\n')
    assert _run("--config", str(cfg), "--gpus", "2", "--explain", "1") == 0
    out = capsys.readouterr().out
    assert "none +fused loss" in out and "fused: G + 8 B x b" in out
    assert "the fused loss does not combine with tp=2" in out
    assert "--train.fused_linear_loss=true" in out.split("Run #1 with:")[1]
    assert _run("--config", str(cfg), "--gpus", "2", "--explain", "0", "--fused-loss", "off") == 0
    table, run = capsys.readouterr().out.split("Run #1 with:")
    assert "fused" not in table
    assert "--train.fused_linear_loss=false" in run  # the plan's choice outvotes the config's


@pytest.mark.parametrize("argv, planned", [
    (["--strategy", "fsdp"], ("fsdp3",)),
    (["--strategy", "fsdp", "--reshard-after-forward", "true"], ("fsdp3",)),
    (["--strategy", "fsdp", "--reshard-after-forward", "false"], ("fsdp2",)),
    (["--strategy", "ddp,fsdp,hsdp"], ("ddp", "fsdp3", "hsdp")),
    (["--strategy", "fsdp2,fsdp3,hsdp"], ("fsdp2", "fsdp3", "hsdp")),  # the planner's own names still work
    (["--strategy", "fsdp,fsdp3"], ("fsdp3",)),
    ([], ()),
])
def test_strategy_takes_the_configs_names(argv, planned):
    assert strategies_from_args(build_parser().parse_args(argv)) == planned


def test_a_config_name_plans_the_same_layouts_as_the_planners(capsys):
    outputs = []
    for strategy in ("fsdp", "fsdp3"):
        assert _run("--model", "gpt-tiny", "--gpus", "2", "--seq-len", "128", "--strategy", strategy) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and "fsdp dp=2" in outputs[0]


def test_scale_table_and_plot(tmp_path, capsys):
    png = tmp_path / "scale.png"
    code = _run("--model", "gpt2-124m", "--scale", "8,64,512,4096", "--strategy", "ddp", "--out", str(png))
    out = capsys.readouterr().out
    assert code == 0 and png.read_bytes()[:4] == b"\x89PNG"
    assert "fixed per-GPU batch" in out and "4096" in out and "efficiency" in out


def test_list_hardware(capsys):
    assert _run("--list-hardware") == 0
    out = capsys.readouterr().out
    assert "h100" in out and "ib-ndr-8x" in out


@pytest.mark.parametrize("argv, expected", [
    (["--model", "gpt-huge"], "unknown model 'gpt-huge'; use one of gpt-tiny"),
    (["--gpu", "h1000"], "unknown GPU 'h1000' (did you mean 'h100'?)"),
    (["--interconnect", "infiniband"], "unknown interconnect 'infiniband'"),
    (["--gpu-memory", "80XB"], "--gpu-memory: '80XB' is not a size; write a number with a unit such as 80GB"),
    (["--gpus", "0"], "--gpus 0 must be at least 1"),
    (["--gpus", "12"], "--gpus 12 does not fill whole nodes of 8 GPUs"),
    (["--gpus-per-node", "0"], "--gpus-per-node 0 must be at least 1"),
    (["--model", "gpt", "--n-layer", "4"], "--model gpt is a custom size: give --n-layer, --n-head and --d-model"),
    (["--model", "gpt", "--n-layer", "4", "--n-head", "5", "--d-model", "64"], "d_model=64 is not divisible by"),
    (["--tp", "1,x"], "--tp '1,x' is not a comma-separated list"),
    (["--tp", "0"], "--tp '0' must list numbers of at least 1"),
    (["--strategy", "ddp,fsdp9"], "--strategy 'ddp,fsdp9' has unknown value(s) fsdp9"),
    (["--strategy", "ddp", "--reshard-after-forward", "false"], "--reshard-after-forward applies to the config's"),
    (["--efficiency", "1.5"], "--efficiency 1.5 must be a fraction"),
    (["--headroom", "1"], "--headroom 1.0 must be a fraction in [0, 1)"),
    (["--seq-len", "-3"], "--seq-len -3 must be at least 1"),
    (["--global-batch", "0"], "--global-batch 0 must be at least 1"),
    (["--vocab-size", "0"], "--vocab-size 0 must be at least 1"),
    (["--scale", "8,64", "--per-gpu-batch", "0"], "--per-gpu-batch 0 must be at least 1"),
    (["--peak-tflops", "-1"], "--peak-tflops -1.0 must be positive"),
    (["--scale", "8,64", "--strategy", "ddp,fsdp3"], "--scale predicts one layout"),
    (["--scale", "8,12"], "--scale size 12 does not fill whole nodes"),
    (["--inter-bw", "fast"], "--inter-bw: 'fast' is not a size"),
    (["--config", "/nonexistent/run.toml"], "config file '/nonexistent/run.toml' does not exist"),
    (["--model", "nowhere.module:build"], "cannot describe model 'nowhere.module:build'"),
    (["--model", "mlp", "--fused-loss", "on"], "--fused-loss on (or train.fused_linear_loss = true in --config) "
                                               "needs meshyard's GPT"),
])
def test_bad_input_is_one_message_and_exit_code_2(argv, expected, capsys):
    assert _run(*argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert expected in captured.err
    assert captured.err.startswith("meshyard plan: ") and "Traceback" not in captured.err


def test_module_entry_point_help():
    proc = subprocess.run([sys.executable, "-m", "meshyard.plan", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0
    assert "--gpu-memory" in proc.stdout and "examples:" in proc.stdout


def test_argparse_rejects_non_numbers_with_exit_code_2(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--gpus", "many"])
    assert exc.value.code == 2
    assert "argument --gpus: invalid int value: 'many'" in capsys.readouterr().err


BUILDER = '''
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.out(nn.functional.gelu(self.fc(self.ln(x))))


class Net(nn.Module):
    def __init__(self, vocab, d=64, n=3):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        x = self.emb(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(vocab_size):
    return Net(vocab_size)
'''


def test_own_builder_is_traced_and_kept_off_tensor_parallelism(tmp_path, capsys):
    path = tmp_path / "mymodel.py"
    path.write_text(BUILDER)
    code = _run("--model", f"{path}:build", "--vocab-size", "1000", "--seq-len", "128", "--gpus", "4",
                "--explain", "0")
    out = capsys.readouterr().out
    expected = 1000 * 64 * 2 + 1000 + 3 * (2 * 64 + 64 * 256 + 256 + 256 * 64 + 64)
    assert code == 0 and f"{expected / 1e3:.4g}k parameters (3 layers" in out
    assert "tensor parallelism needs a known block layout" in out
