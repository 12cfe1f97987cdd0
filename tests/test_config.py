"""Config files, --key=value overrides and their errors; every file in configs/ loads."""

from pathlib import Path

import pytest

from gptkit.config import ConfigError, TrainConfig, config_to_json, load_config, read_config_file

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.py"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_file_loads(path):
    cfg = load_config(TrainConfig, [str(path)])
    assert isinstance(cfg, TrainConfig)
    for key, value in read_config_file(str(path)).items():  # every assignment reached the config
        assert getattr(cfg, key) == value


def test_file_then_overrides_with_type_conversion(tmp_path):
    f = tmp_path / "c.py"
    f.write_text('"""doc"""\nn_layer = 3\nmax_iters = 2 * 500\nlr_decay_iters = max_iters\nlearning_rate = 1e-3\n')
    cfg = load_config(TrainConfig, [str(f), "--learning_rate=1", "--compile=False", "--batch_size", "7",
                                    "--eval_only", "--dataset=foo"])
    assert cfg.n_layer == 3 and cfg.max_iters == 1000 and cfg.lr_decay_iters == 1000
    assert cfg.learning_rate == 1.0 and isinstance(cfg.learning_rate, float)
    assert cfg.compile is False and cfg.batch_size == 7 and cfg.eval_only is True and cfg.dataset == "foo"
    assert load_config(TrainConfig, ["--compile=auto"]).compile is None
    assert load_config(TrainConfig, ["--compile=True"]).compile is True
    assert '"n_layer": 12' in config_to_json(TrainConfig())


def test_unknown_key_suggests_the_closest(tmp_path):
    with pytest.raises(ConfigError, match="'learning_rat'.*did you mean 'learning_rate'"):
        load_config(TrainConfig, ["--learning_rat=1"])
    f = tmp_path / "c.py"
    f.write_text("n_layers = 4\n")
    with pytest.raises(ConfigError, match=r"'n_layers' \(in .*c\.py\).*'n_layer'"):
        load_config(TrainConfig, [str(f)])


@pytest.mark.parametrize(
    "arg, key",
    [("--batch_size=abc", "batch_size"), ("--batch_size=1.5", "batch_size"), ("--compile=maybe", "compile"),
     ("--learning_rate=fast", "learning_rate"), ("--eval_only=2", "eval_only"), ("--dtype=float64", "dtype"),
     ("--data_mode=shuffle", "data_mode"), ("--n_embd=100", "n_embd"), ("--batch_size=0", "batch_size")],
)
def test_bad_values_name_the_key(arg, key):
    with pytest.raises(ConfigError, match=key):
        load_config(TrainConfig, [arg])


def test_bad_types_in_a_file_name_the_key(tmp_path):
    f = tmp_path / "c.py"
    f.write_text('n_layer = "six"\n')
    with pytest.raises(ConfigError, match="n_layer expects int"):
        load_config(TrainConfig, [str(f)])
    f.write_text("bias = 1\n")
    with pytest.raises(ConfigError, match="bias expects bool"):
        load_config(TrainConfig, [str(f)])


def test_config_files_are_parsed_not_executed(tmp_path):
    f = tmp_path / "c.py"
    marker = tmp_path / "pwned"
    f.write_text(f"import os\nos.system('touch {marker}')\n")
    with pytest.raises(ConfigError, match="line 1: only plain assignments"):
        load_config(TrainConfig, [str(f)])
    f.write_text(f"out_dir = __import__('os').system('touch {marker}')\n")
    with pytest.raises(ConfigError, match="literals or arithmetic"):
        load_config(TrainConfig, [str(f)])
    assert not marker.exists()
    with pytest.raises(ConfigError, match="not found"):
        load_config(TrainConfig, [str(tmp_path / "missing.py")])


def test_help_lists_every_field(capsys):
    with pytest.raises(SystemExit) as e:
        load_config(TrainConfig, ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("learning_rate", "gradient_accumulation_steps", "compile", "init_from"):
        assert f"--{name}=" in out
