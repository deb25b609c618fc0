"""Config: defaults < YAML < flags, one source of defaults, one-line errors."""

from __future__ import annotations

import dataclasses

import pytest

from hvdtrain.cli import build_parser, main
from hvdtrain.config import SECTIONS, Config, ConfigError, build_config, field_index
from hvdtrain.options import config_from_args


def parse(*argv: str) -> Config:
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_defaults_come_from_the_dataclasses():
    config = parse()
    assert config == Config()
    assert config.train.batch_size == 32 and config.data.dataset == "digits"


def test_yaml_overrides_defaults_and_flags_override_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  epochs: 7\n  batch_size: 16\noptim:\n  learning_rate: 0.2\n"
                    "dataset: synthetic\n")
    config = parse("--config", str(path), "--batch-size", "8")
    assert config.train.epochs == 7            # from YAML
    assert config.train.batch_size == 8        # flag beats YAML
    assert config.optim.learning_rate == 0.2   # YAML, int-or-float accepted
    assert config.data.dataset == "synthetic"  # bare field name at top level
    assert config.model.model == "mlp"         # default untouched


def test_help_lists_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, (section, f) in field_index().items():
        assert "--" + name.replace("_", "-") in text, name
        default = f.default_factory() if callable(f.default_factory) else f.default
        assert f"default: {default})" in text, name
        if f.metadata["choices"]:   # shown even where a metavar stands in the usage line
            assert "choices: " + ", ".join(f.metadata["choices"]) in text, name


def test_field_names_are_unique_across_sections():
    names = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("overrides, message", [
    ({"batch_size": 0}, "'batch_size' must be at least 1, got 0"),
    ({"epochs": -1}, "'epochs' must be at least 1, got -1"),
    ({"learning_rate": 0.0}, "'learning_rate' must be greater than 0, got 0.0"),
    ({"learning_rate": "fast"}, "'learning_rate' must be a float, got 'fast'"),
    ({"loop": "fitt"}, "'loop' must be one of fit, custom, got 'fitt'; did you mean 'fit'?"),
    ({"epochs": True}, "'epochs' must be a int, got True"),
    ({"dataset": "npz"}, "--dataset npz needs --data-path FILE.npz"),
    ({"dataset": "csv", "data_path": "train-*"},
     "--val-data-path is not set; give a glob of files, e.g. 'data/train-*'"),
    ({"elastic": True}, "--elastic needs --run-dir: ranks that join later must find the run"),
    ({"elastic": True, "run_dir": "r", "accumulation_steps": 2},
     "--elastic supports in-memory datasets without --accumulation-steps"),
    ({"elastic": True, "run_dir": "r", "lr_schedule": "plateau"},
     "--elastic does not support --lr-schedule plateau (its state would not reach joining "
     "ranks); use constant, cosine or step"),
    ({"elastic": True, "run_dir": "r", "autotune": True},
     "--autotune times fixed settings on a fixed set of ranks; run it without --elastic, then "
     "give the elastic run the flags it prints"),
    ({"elastic": True, "run_dir": "r", "steps_per_epoch": 5},
     "--steps-per-epoch does not apply to --elastic, whose epochs are whole passes over the "
     "data (re-sharded when the world changes); drop it"),
    ({"steps_per_epoch": 5, "accumulation_steps": 2},
     "--steps-per-epoch 5 must be a multiple of --accumulation-steps 2: an epoch would end "
     "between updates"),
    ({"compression": "bf16", "reduction": "adasum"},
     "--compression bf16 cannot travel with --reduction adasum (Horovod's Adasum takes no "
     "bfloat16); use --compression fp16 or none"),
    ({"compression": "powersgd", "zero_stage": 1},
     "--compression powersgd compresses whole gradients, which ZeRO reduce-scatters in "
     "pieces; use --zero-stage 0 or another --compression"),
    ({"compression": "powersgd", "reduction": "adasum"},
     "--compression powersgd approximates the ranks' sum, not Adasum's combination; use "
     "--reduction mean or another --compression"),
    ({"compression": "powersgd", "elastic": True, "run_dir": "r"},
     "--compression powersgd keeps per-rank error buffers that a world change would lose; "
     "drop --elastic or use another --compression"),
    ({"compression": "powersgd", "precision": "mixed_float16"},
     "--compression powersgd with --precision mixed_float16: a loss-scaled step that "
     "overflows would leave non-finite values in the error buffers; use --precision "
     "mixed_bfloat16 or float32"),
    ({"compression": "powersgd", "powersgd_rank": 0}, "'powersgd_rank' must be at least 1, got 0"),
])
def test_bad_values_are_named_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as caught:
        build_config(overrides)
    assert str(caught.value) == message


def test_unknown_yaml_key_suggests_the_closest(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  epoch: 3\n")
    with pytest.raises(ConfigError, match=r"unknown option 'train.epoch'; did you mean 'epochs'"):
        parse("--config", str(path))


def test_yaml_that_does_not_parse(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train: [epochs: 3\n")
    with pytest.raises(ConfigError, match="YAML does not parse at line"):
        parse("--config", str(path))


def test_cli_reports_a_mistake_in_one_line_with_exit_2(capsys, tmp_path):
    assert main(["--batch-size", "0", "--run-dir", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert err == "hvdtrain: error: 'batch_size' must be at least 1, got 0\n"
    assert not (tmp_path / "never").exists()


def test_resolved_config_round_trips_through_yaml(tmp_path):
    config = build_config({"epochs": 3, "hidden_units": [8, 4]})
    path = tmp_path / "config.yaml"
    path.write_text(config.to_yaml())
    assert parse("--config", str(path)) == config


def test_resume_takes_auto_and_keeps_the_bare_flag():
    parser = build_parser()

    def resume(*argv: str) -> str:
        return config_from_args(parser.parse_args(["train", *argv])).train.resume

    assert resume() == "never"
    assert resume("--resume") == "required"
    assert resume("--resume", "auto") == "auto"
    assert resume("--resume", "--epochs", "3") == "required"
    for yaml_value, mode in ((True, "required"), (False, "never"), ("auto", "auto")):
        assert build_config({"resume": yaml_value}).train.resume == mode
