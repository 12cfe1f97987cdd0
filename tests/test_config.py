"""Config files, --key=value overrides and their errors; every file in configs/ loads."""

import json
import re
import subprocess
import sys
import typing
from dataclasses import fields
from pathlib import Path

import pytest

from gptkit.config import ConfigError, TrainConfig, config_to_json, load_config, read_config_file
from model import GPTConfig

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.py"))


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


# ----------------------------------------------------------------------------- files see the command line


def test_a_files_lines_see_the_command_line(char_dataset, tmp_path):
    import train

    f = tmp_path / "c.py"
    f.write_text("max_iters = 100\nlr_decay_iters = max_iters\nwarmup_iters = max_iters // 10\n")
    assert load_config(TrainConfig, [str(f)]).lr_decay_iters == 100
    cfg = load_config(TrainConfig, ["--max_iters=7", str(f)])  # the command line wins wherever it stands
    assert (cfg.max_iters, cfg.lr_decay_iters, cfg.warmup_iters) == (7, 7, 0)
    out = tmp_path / "out"
    train.main([str(f), "--max_iters=7", f"--dataset={char_dataset}", f"--out_dir={out}", "--n_layer=1",
                "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=2", "--gradient_accumulation_steps=1",
                "--eval_interval=7", "--eval_iters=1", "--device=cpu", "--compile=False", "--dtype=float32"])
    written = json.loads((out / "config.json").read_text())
    assert (written["max_iters"], written["lr_decay_iters"], written["warmup_iters"]) == (7, 7, 0)


def test_a_later_file_wins_and_an_override_skips_the_files_line(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("max_iters = 10\nwarmup_iters = 3\n")
    b.write_text("max_iters = 20\n")
    cfg = load_config(TrainConfig, [str(a), str(b)])
    assert (cfg.max_iters, cfg.warmup_iters) == (20, 3)
    a.write_text('max_iters = "many"\nlr_decay_iters = max_iters\n')  # the command line's: never evaluated
    assert load_config(TrainConfig, [str(a), "--max_iters=5"]).lr_decay_iters == 5
    a.write_text("lr_decay_iters = max_iters\n")
    with pytest.raises(ConfigError, match="'max_iters' is not assigned earlier in the file nor on the command"):
        load_config(TrainConfig, [str(a)])


# ----------------------------------------------------------------------------- bounded arithmetic


BOMBS = {  # id: (the file's second line, what the error says after the file's name)
    "10**10**5": ("max_iters = 10**10**5", " line 2, max_iters: .* is outside the 64-bit integer range"),
    "2**64": ("max_iters = 2**64", r" line 2, max_iters: '2 \*\* 64' is outside the 64-bit integer range"),
    "-2**63-1": ("max_iters = -2**63 - 1", " line 2, max_iters: .* is outside the 64-bit integer range"),
    "5000 digits": ("max_iters = " + "9" * 5000, " line 2: syntax error: Exceeds the limit"),
    "str*10**9": ('out_dir = "x" * 10**9', " line 2, out_dir: .* would be a string of 1,000,000,000 characters; "
                                           "at most 10,000 are allowed"),
    "10**9*str": ('out_dir = 10**9 * "x"', " line 2, out_dir: .* would be a string of 1,000,000,000 characters"),
    "str%": ('out_dir = "%099999999d" % 1', r" line 2, out_dir: .* strings can only be joined \(\+\) and "
                                            r"repeated \(\*\)"),
    "long literal": ('out_dir = "' + "x" * 10_001 + '"', " line 2, out_dir: a string of 10,001 characters; at "
                                                          "most 10,000"),
    "1e999": ("learning_rate = 1e999", " line 2, learning_rate: .* is not a finite number"),
    "10.0**400": ("learning_rate = 10.0 ** 400", " line 2, learning_rate: .* is outside the floating-point range"),
    "bytes": ('out_dir = b"out"', " line 2, out_dir: values must be numbers, strings, True/False or None"),
    "-str": ('out_dir = -"out"', " line 2, out_dir: cannot evaluate"),
    # too deep to evaluate, or already to parse (where depends on the stack the test runs on)
    "deep": ("max_iters = " + "+".join(["1"] * 3000), "( line 2, max_iters: the|: an) expression is nested too "
                                                      "deeply"),
    "deeper": ("max_iters = " + "-" * 100_000 + "1", ": an expression is nested too deeply to parse"),
}


@pytest.mark.parametrize("line, message", BOMBS.values(), ids=BOMBS.keys())
def test_a_files_arithmetic_is_bounded(tmp_path, line, message):
    f = tmp_path / "c.py"
    f.write_text(f'"""doc"""\n{line}\n')
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, [str(f)])
    assert re.match(re.escape(str(f)) + message, str(e.value)) and "\n" not in str(e.value), str(e.value)[:300]


def test_the_bounds_keep_every_int64(tmp_path):
    f = tmp_path / "c.py"
    f.write_text('max_iters = 2**63 - 1\nseed = -2**63\nwandb_run_name = "ab" * 5000 + ""\n')
    cfg = load_config(TrainConfig, [str(f)])
    assert (cfg.max_iters, cfg.seed, len(cfg.wandb_run_name)) == (2**63 - 1, -(2**63), 10_000)
    for arg in ("--max_iters=1e300", f"--max_iters={2**63}"):
        with pytest.raises(ConfigError, match="max_iters must lie in the 64-bit integer range"):
            load_config(TrainConfig, [arg])


def test_the_issues_bomb_is_one_line_at_once(tmp_path):
    f = tmp_path / "bomb.py"
    f.write_text("max_iters = 10**10**10\n")
    # the timeout only keeps a regression from hanging the suite; it is no measure of speed
    res = subprocess.run([sys.executable, str(REPO / "train.py"), str(f)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert res.returncode != 0 and res.stdout == ""
    assert res.stderr == f"error: {f} line 1, max_iters: '10 ** 10 ** 10' is outside the 64-bit integer range\n"


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path):
    f = tmp_path / "latin1.py"
    f.write_bytes("wandb_run_name = 'café'\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.py is not UTF-8 text \(byte 21 is 0xe9\); save it as UTF-8"):
        load_config(TrainConfig, [str(f)])
    f.write_bytes("\ufeffwandb_run_name = 'café'\n".encode())  # with the byte-order mark some editors write
    assert load_config(TrainConfig, [str(f)]).wandb_run_name == "café"


# ----------------------------------------------------------------------------- the model's settings


def test_the_model_settings_are_gptconfigs():
    ours, theirs = {f.name: f for f in fields(TrainConfig)}, {f.name: f for f in fields(GPTConfig)}
    settings = GPTConfig.setting_names()
    assert set(settings) == set(theirs) - {"vocab_size", "vocab_multiple", "ln_eps"}
    train_hints, model_hints = typing.get_type_hints(TrainConfig), typing.get_type_hints(GPTConfig)
    for name in settings:
        assert ours[name].default == theirs[name].default and train_hints[name] == model_hints[name]
        assert ours[name].metadata["help"] == theirs[name].metadata["help"] != ""
    # model_config passes each one on: every setting at a value of its own reaches the GPTConfig
    changed = dict(block_size=64, n_layer=3, n_head=4, n_embd=64, dropout=0.25, bias=False, arch="modern",
                   rope=False, rope_base=500.0, norm="layernorm", qk_norm=False, activation="gelu_tanh",
                   tie_embeddings=True, zero_init_proj=False, logit_softcap=5.0)
    assert set(changed) == set(settings)
    model = TrainConfig(**changed).model_config(vocab_size=65, vocab_multiple=8)
    assert {k: getattr(model, k) for k in settings} == changed
    assert (model.vocab_size, model.vocab_multiple) == (65, 8)
    with pytest.raises(ConfigError, match="norm must be one of layernorm, rmsnorm"):
        load_config(TrainConfig, ["--norm=batchnorm"])


def test_help_shows_every_model_setting_with_its_description(capsys):
    with pytest.raises(SystemExit):
        load_config(TrainConfig, ["--help"])
    lines = capsys.readouterr().out.splitlines()
    for f in fields(GPTConfig):
        shown = [line for line in lines if line.strip().startswith(f"--{f.name}=")]
        if f.name in GPTConfig.setting_names():
            assert len(shown) == 1 and shown[0].endswith(f.metadata["help"]), f.name
        else:
            assert not shown, f.name
