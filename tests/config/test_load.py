from __future__ import annotations

import dataclasses

import pytest

from meshyard.config.dump import config_to_toml
from meshyard.config.checks import section_problems
from meshyard.config.load import ConfigError, config_from_dict, load_config, load_section, parse_override
from meshyard.config.sections import SECTIONS, Config, ServeConfig


def write(tmp_path, text: str):
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return path


def test_defaults_without_file():
    # Loading looks at nothing but its inputs: run.nproc = 0 ("this machine's default")
    # is resolved by the launching process (meshyard.validate.with_local_nproc).
    assert load_config() == Config()


def test_every_field_is_documented():
    for name, cls in SECTIONS.items():
        assert cls.__doc__, name
        for f in dataclasses.fields(cls):
            assert len(f.metadata.get("doc", "")) > 10, f"{name}.{f.name} lacks a description"


def test_precedence_cli_over_file_over_defaults(tmp_path):
    path = write(tmp_path, "[train]\nsteps = 7\nglobal_batch = 16\n[model]\nname = 'gpt-mini'\n")
    cfg = load_config(path, ["--train.steps=9", "--optim.lr", "0.5"])
    assert cfg.train.steps == 9  # CLI beats file
    assert cfg.train.global_batch == 16  # file beats default
    assert cfg.model.name == "gpt-mini"
    assert cfg.optim.lr == 0.5 and isinstance(cfg.optim.lr, float)
    assert cfg.train.seed == Config().train.seed  # default kept


@pytest.mark.parametrize(
    "text, expected",
    [
        ("--train.steps=12", ("train", "steps", 12)),
        ("--model.name=gpt-mini", ("model", "name", "gpt-mini")),
        ("--parallel.reshard_after_forward=false", ("parallel", "reshard_after_forward", False)),
        ("--optim.betas=[0.8, 0.99]", ("optim", "betas", [0.8, 0.99])),
        ("--data.paths='a b.txt'", ("data", "paths", "a b.txt")),
        ("--optim.lr=3e-4", ("optim", "lr", 3e-4)),
    ],
)
def test_parse_override(text, expected):
    assert parse_override(text) == expected


def test_round_trip_through_toml(tmp_path):
    cfg = load_config(None, ["--model.options={ width = 3 }", "--data.paths=['x.txt']", "--optim.lr=0.01",
                             "--parallel.strategy=fsdp", "--run.name=rt"])
    for docs in (False, True):
        path = write(tmp_path, config_to_toml(cfg, with_docs=docs))
        assert load_config(path) == cfg
    assert config_from_dict(dataclasses.asdict(cfg)) == cfg


def test_all_problems_reported_at_once(tmp_path):
    path = write(tmp_path, "[trian]\nsteps = 1\n[train]\nstesp = 3\nglobal_batch = 'big'\n"
                           "[parallel]\nstrategy = 'fdsp'\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["--optim.lr=fast", "notanoverride"])
    problems = info.value.problems
    text = str(info.value)
    assert len(problems) == 6, problems
    assert "unknown section [trian]" in text and "did you mean 'train'" in text
    assert "unknown key 'train.stesp'" in text and "did you mean 'steps'" in text
    assert "train.global_batch = 'big' should be int, not str" in text
    assert "parallel.strategy = 'fdsp'" in text and "did you mean 'fsdp'" in text
    assert "optim.lr = 'fast' should be float" in text
    assert "notanoverride" in text


def test_bool_and_int_are_not_confused():
    with pytest.raises(ConfigError, match="train.steps = True should be int"):
        load_config(None, ["--train.steps=true"])
    with pytest.raises(ConfigError, match="train.deterministic = 1 should be bool"):
        load_config(None, ["--train.deterministic=1"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[train\nsteps = 1"))


@pytest.mark.parametrize("command", [["run"], ["config", "show"]])
def test_non_utf8_file_exits_2_naming_file_and_line(tmp_path, capsys, command):
    from meshyard.cli import main

    path = tmp_path / "latin1.toml"
    path.write_bytes("[train]\nsteps = 3\n# déjà vu\n".encode("latin-1"))
    assert main([*command, str(path), f"--run.dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err
    assert f"{path}, line 3: byte 0xe9 is not UTF-8" in err and "Traceback" not in err


def test_config_recorded_before_a_key_was_retired_still_loads(tmp_path):
    """Earlier runs recorded ``data.tokenizer = "byte"`` in config.toml; resuming them must work,
    as today's byte tokenizer."""
    cfg = load_config(write(tmp_path, "[data]\ntokenizer = 'byte'\nseq_len = 64\n"))
    assert cfg.data.seq_len == 64 and cfg.data.tokenizer == "bytes"
    assert load_config(write(tmp_path, "[data]\ntokenizer = 'bpe:512'\n")).data.tokenizer == "bpe:512"


def test_one_section_is_read_alone_from_its_table_and_overrides(tmp_path):
    path = tmp_path / "cfg.toml"
    path.write_text("[serve]\nport = 9000\nmax_queue = 8\n\n[train]\nsteps = 'not checked here'\n")
    serve = load_section("serve", path, ["--serve.max_queue=16"])
    assert serve == ServeConfig(port=9000, max_queue=16)
    assert load_section("serve") == ServeConfig()


def test_a_section_read_alone_reports_every_problem_at_once(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_section("serve", None, ["--serve.max_quue=3", "--serve.port=abc", "--train.steps=3"])
    problems = "\n".join(info.value.problems)
    assert len(info.value.problems) == 3
    assert "did you mean 'max_queue'" in problems and "serve.port = 'abc' should be int" in problems
    assert "--train.steps sets [train], but only [serve] is read here" in problems
    assert section_problems("serve", ServeConfig(max_queue=0)) == ["serve.max_queue = 0 must be at least 1"]

