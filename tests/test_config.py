"""Config files, --key=value overrides and their errors; every file in configs/ loads."""

import importlib
import inspect
import json
import re
import subprocess
import sys
import typing
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from gptkit.config import DecodeSettings, InferenceSettings, SamplingSettings, TrainConfig
from gptkit.options import Alias, ConfigError, config_to_json, load_config, read_config_file, setting
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
    with pytest.raises(ConfigError, match=r"'n_layers' \(in .*c\.py line 1\).*'n_layer'"):
        load_config(TrainConfig, [str(f)])


def test_a_typo_in_a_file_is_named_at_its_own_line_even_when_a_later_line_reads_the_key(tmp_path):
    # configs/shakespeare_cpu.py with learning_rate misspelt: its min_lr line reads learning_rate
    text = (REPO / "configs" / "shakespeare_cpu.py").read_text()
    typo_line = text.splitlines().index("learning_rate = 1e-3") + 1
    f = tmp_path / "typo.py"
    f.write_text(text.replace("learning_rate = 1e-3", "learning_rte = 1e-3"))
    assert "min_lr = learning_rate / 10" in f.read_text()  # the later line that reads the key
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, [str(f)])
    assert str(e.value) == (f"unknown config key 'learning_rte' (in {f} line {typo_line}); "
                            "did you mean 'learning_rate'?")
    # another spelling of a key is a known key at its own line too
    g = tmp_path / "alias.py"
    g.write_text('to = "x.png"\nsizes = "2"\n')
    assert load_config(Lists, [str(g)]).out == "x.png"


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
    from conftest import train_script

    train = train_script()

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


# ----------------------------------------------------------------------------- comma lists and other spellings


@dataclass
class Lists:
    sizes: list[int] = setting([1, 8], "sizes, a row each")
    names: list[str] = setting(["a"], "names", ("a", "b", "c"))
    flags: list[bool] = setting([False], "flags")
    maybe: list[str] | None = setting(None, "names, or auto")
    out: str = setting("", "where")
    ALIASES = {"to": Alias("out", "the older spelling")}


def test_a_list_field_takes_a_comma_list(tmp_path, capsys):
    cfg = load_config(Lists, ["--sizes=12,16,32", "--names", "b, a", "--flags=False,True"], allow_files=False)
    assert (cfg.sizes, cfg.names, cfg.flags, cfg.maybe) == ([12, 16, 32], ["b", "a"], [False, True], None)
    assert load_config(Lists, ["--maybe=x,y"]).maybe == ["x", "y"]
    first, second = Lists(), Lists()
    first.sizes.append(3)
    assert second.sizes == [1, 8]  # each config its own default list
    f = tmp_path / "c.py"
    f.write_text('sizes = "4,5"\nnames = "c"\nflags = True\n')  # in a file: the same text, or one value
    assert (lambda c: (c.sizes, c.names, c.flags))(load_config(Lists, [str(f)])) == ([4, 5], ["c"], [True])
    for arg, message in (("--sizes=1,x", "sizes expects a comma-separated list of int, got '1,x'"),
                         ("--sizes=1.5", "sizes expects a comma-separated list of int"),
                         ("--flags=True,maybe", "flags expects a comma-separated list of bool"),
                         ("--names=a,z", "names must be one of a, b, c; got 'z'")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(Lists, [arg])
    with pytest.raises(SystemExit):
        load_config(Lists, ["--help"], allow_files=False, prog="x.py", description="What x does.")
    out = capsys.readouterr().out
    assert out.startswith("usage: python x.py [--key=value ...]\n\nWhat x does.\n")
    assert re.search(r"--sizes=1,8 +int,\.\.\. +sizes, a row each", out)
    assert re.search(r"--to=\.\.\. +alias +same as --out: the older spelling", out)


def test_an_alias_and_its_setting_may_not_disagree():
    assert load_config(Lists, ["--to=a"]).out == "a"
    assert load_config(Lists, ["--to=a", "--out=a"]).out == "a"
    with pytest.raises(ConfigError, match="--out and --to are two spellings of out, given different values"):
        load_config(Lists, ["--out=a", "--to", "b"])


@dataclass
class Folders:
    runs: list[str] = setting([], "the folders, the bare arguments")
    depth: list[int] = setting([0], "depths")
    out: str = setting("o.png", "what to write")
    logy: bool = setting(False, "a flag")
    POSITIONAL = "runs"


def test_a_positional_list_field_takes_the_bare_arguments(tmp_path, capsys):
    cfg = load_config(Folders, ["a/", "--out", "x.png", "b,c/", "--logy", "d", "--depth=1,2"], allow_files=False)
    assert (cfg.runs, cfg.out, cfg.logy, cfg.depth) == (["a/", "b,c/", "d"], "x.png", True, [1, 2])  # taken whole
    assert load_config(Folders, ["--runs=a,b"], allow_files=False).runs == ["a", "b"]
    with pytest.raises(ConfigError, match=r"runs given twice: as bare arguments and as --runs; give one of them"):
        load_config(Folders, ["a", "--runs=b"], allow_files=False)
    with pytest.raises(ConfigError, match="unknown config key 'outt'"):
        load_config(Folders, ["a", "--outt=x"], allow_files=False)
    with pytest.raises(SystemExit):
        load_config(Folders, ["--help"], allow_files=False, prog="x.py")
    assert capsys.readouterr().out.startswith("usage: python x.py [--key=value ...] RUNS [RUNS ...]\n")
    # where a script takes config files (train.py), the bare arguments stay config files
    f = tmp_path / "c.py"
    f.write_text('out = "from_file.png"\n')
    assert load_config(Folders, [str(f)], allow_files=True).out == "from_file.png"
    with pytest.raises(ConfigError, match="unexpected argument 'a'"):  # a class without POSITIONAL: an error
        load_config(Lists, ["a"], allow_files=False)


# ----------------------------------------------------------------------------- the scripts' settings, declared once

SCRIPTS = {"train": "TrainConfig", "sample": "SampleConfig", "chat": "ChatConfig", "serve": "ServeConfig",
           "eval": "EvalConfig", "export": "ExportConfig", "bench": "BenchConfig", "plot": "PlotConfig",
           "prepare.chat": "ChatDataConfig", "prepare.fineweb": "FinewebConfig",
           "prepare.openwebtext": "OpenWebTextConfig", "prepare.shakespeare": "ShakespeareConfig",
           "prepare.shakespeare_char": "ShakespeareCharConfig", "prepare.text": "TextConfig",
           "prepare.tokenizer": "TokenizerConfig"}


def script_config(script: str) -> type:
    return getattr(importlib.import_module(script), SCRIPTS[script])


def test_the_inference_settings_are_declared_once():
    """Each inference script's config extends the shared class that holds what it takes, and declares again only
    the settings it means differently: chat loads a chat model and replies a little cooler, eval's dtype is the
    precision of autocast (its weights stay float32)."""
    sample, chat, serve, evaluate = (script_config(s) for s in ("sample", "chat", "serve", "eval"))
    assert issubclass(sample, SamplingSettings) and issubclass(chat, SamplingSettings)
    assert issubclass(serve, DecodeSettings) and not issubclass(serve, SamplingSettings)
    assert issubclass(evaluate, InferenceSettings) and not issubclass(evaluate, DecodeSettings)
    shared = {f.name for f in fields(SamplingSettings)}
    redeclared = {cls.__name__: set(inspect.get_annotations(cls)) & shared for cls in (sample, chat, serve, evaluate)}
    assert redeclared == {"SampleConfig": set(), "ChatConfig": {"init_from", "temperature"}, "ServeConfig": set(),
                          "EvalConfig": {"dtype"}}
    by_name = {f.name: f for f in fields(chat)}
    assert by_name["temperature"].metadata == {f.name: f for f in fields(SamplingSettings)}["temperature"].metadata
    assert (chat().temperature, sample().temperature) == (0.7, 0.8)
    for cls in (sample, chat, serve, evaluate):  # the shared checks, in every script
        with pytest.raises(ConfigError, match="not both"):
            load_config(cls, ["--ckpt=out", "--init_from=gpt2"], allow_files=False)
        with pytest.raises(ConfigError, match="--init_from=scratch is a train.py option"):
            load_config(cls, ["--init_from=scratch"], allow_files=False)
    for cls in (sample, chat):
        with pytest.raises(ConfigError, match=r"seed must be in \[0, 2\*\*63\)"):
            load_config(cls, ["--seed=-1"], allow_files=False)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_scripts_help_comes_from_the_one_parser(script, capsys):
    with pytest.raises(SystemExit) as e:
        importlib.import_module(script).main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python {script.replace('.', '/')}.py ")
    lines = [line.strip() for line in out.partition("options (default, type, description):")[2].splitlines()]
    for f in fields(script_config(script)):  # every setting, documented where it is defined, shown once
        assert f.metadata["help"], f.name
        shown = [line for line in lines if line.startswith(f"--{f.name}=")]
        assert len(shown) == 1 and shown[0].endswith(f.metadata["help"]), f.name


@pytest.mark.parametrize("script, argv, fragment", [
    ("export", ["--ckpt=x", "--ot=y"], "unknown config key 'ot' (in the command line); did you mean 'out'?"),
    ("export", ["--ckpt=x", "--out=y", "--overwrite=maybe"], "overwrite expects bool, got 'maybe'"),
    ("export", ["--ckpt=x", "out"], "unexpected argument 'out'"),
    ("bench", ["--acum=2"], "unknown config key 'acum' (in the command line); did you mean 'accum'?"),
    ("bench", ["--accum=two"], "accum expects int, got 'two'"),
    ("bench", ["--decode_batch=1,eight"], "decode_batch expects a comma-separated list of int, got '1,eight'"),
    ("bench", ["--compile_scope=model,everything"], "compile_scope must be one of model, blocks; got 'everything'"),
    ("plot", ["out/", "--logyy"], "unknown config key 'logyy' (in the command line); did you mean 'logy'?"),
    ("prepare.chat", ["--input=c.jsonl", "--train_on=everything"], "train_on must be one of assistant, all"),
    ("prepare.chat", ["--name=x"], "--input is required"),
    ("prepare.fineweb", ["--sampel=sample-10BT"], "unknown config key 'sampel' (in the command line); did you mean"),
    ("prepare.openwebtext", ["--streaming=maybe"], "streaming expects bool, got 'maybe'"),
    ("prepare.shakespeare", ["--val_fraction=a"], "val_fraction expects float, got 'a'"),
    ("prepare.shakespeare_char", ["--tokeniser=char"], "unknown config key 'tokeniser' (in the command line)"),
    ("prepare.text", ["--num_proc=-1"], "num_proc must be >= 0"),
    ("prepare.tokenizer", ["--name=x"], "--vocab_size is required"),
    ("prepare.tokenizer", ["--vocab_size=500", "--name=x", "in.txt"], "unexpected argument 'in.txt'"),
])
def test_every_script_names_a_bad_key_or_value_in_one_line(script, argv, fragment):
    with pytest.raises(SystemExit) as e:
        importlib.import_module(script).main(argv)
    message = e.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    assert fragment in message, message
