"""The typed command-line parser of the scripts: a dataclass, filled from --key=value (or --key value) arguments
and, for train.py, plain-Python config files. (The benchmarks that take a few options use cli.ArgumentParser.)

    @dataclass
    class PlotConfig:
        runs: list[str] = setting([], "run folders holding metrics.jsonl")
        x: str = setting("step", "x axis", ("step", "tokens", "time"))
        POSITIONAL = "runs"  # the bare arguments: python plot.py out-a/ out-b/

    cfg = load_config(PlotConfig, argv, allow_files=False, prog="plot.py", description=__doc__)

Every field is documented where it is defined (`setting(default, help, choices)`), and --help lists them all
with their defaults and types. Every value is converted to its field's type; an unknown key or a value of the
wrong type is a one-line error that names the key. A list field (list[int], list[str], list[bool]) takes a comma
list, `--batch_size=12,16,32`. A config may accept other spellings of its keys (ALIASES = {name: Alias(...)}),
which --help lists, and a script without config files may name one list field that takes the bare arguments
(POSITIONAL). A config file (train.py's: bare arguments are config files there) holds assignments only; it is
parsed, never executed, and its arithmetic is bounded.

Nothing here imports torch: the prepare scripts and plot.py use it too. gptkit/config.py holds the configs of
the training and inference scripts; the scripts import the parser's names from here.
"""

from __future__ import annotations

import ast
import difflib
import json
import math
import operator
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any

from gptkit.errors import ConfigError


@dataclass(frozen=True)
class Alias:
    """Another spelling of a setting (nanoGPT's), accepted on the command line and in config files and listed
    by --help: `--name=VALUE` means `--key=VALUE`, or, with `resolve`, the (key, value) it makes of VALUE
    (nanoGPT's --start=FILE:prompt.txt is --prompt_file=prompt.txt). A config dataclass lists its aliases in
    a class attribute ALIASES = {name: Alias(...)}."""

    key: str
    help: str
    resolve: Any = None  # (value: str) -> (key, value)

    def apply(self, value: Any) -> tuple[str, Any]:
        return self.resolve(value) if self.resolve is not None and isinstance(value, str) else (self.key, value)


def _aliases(cls: type) -> dict[str, Alias]:
    return getattr(cls, "ALIASES", {})


def _positional(cls: type) -> str | None:
    """The list field that a config class names in its class attribute POSITIONAL = "field": the command line's
    bare (non --key) arguments are its items, each taken whole (a comma in a folder name stays), and --help's
    usage line shows them. Only for a script that takes no config files (whose bare arguments they are)."""
    return getattr(cls, "POSITIONAL", None)


def setting(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A dataclass field with its one-line description (shown by --help) and, optionally, allowed values (for a
    list field: of each item)."""
    metadata = {"help": help, "choices": choices}
    if isinstance(default, list):  # a comma list (list[int], list[str], ...): each config gets its own copy
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def settings_of(config: type, names: tuple[str, ...], class_name: str) -> type:
    """A dataclass with the fields `names` of the dataclass `config`: their types, defaults, help and choices."""
    hints = typing.get_type_hints(config)
    declared = {f.name: f for f in fields(config)}
    return make_dataclass(class_name,
                          [(n, hints[n], field(default=declared[n].default, metadata=declared[n].metadata))
                           for n in names],
                          namespace={"__module__": __name__})



def redefault(cls: type, name: str, default: Any) -> Any:
    """The field `name` of the dataclass `cls` (its help and choices) with a script's own default."""
    declared = next(f for f in fields(cls) if f.name == name)
    return field(default=default, metadata=declared.metadata)


# ----------------------------------------------------------------------------- loading


def load_config(cls: type, argv: list[str], allow_files: bool = True, prog: str = "train.py",
                description: str = ""):
    """Build `cls` from argv: config files (positional, applied in order), then --key=value / --key value
    overrides. `--help` prints `description`, then every field, and exits."""
    return build_config(cls, parse_args(cls, argv, allow_files, prog, description))


def parse_args(cls: type, argv: list[str], allow_files: bool = True, prog: str = "train.py",
               description: str = "") -> dict[str, Any]:
    """The values that argv sets explicitly, converted to the fields' types: the config files' (in order, a later
    file winning), then the --key=value overrides, which win wherever they stand and which the files' lines see."""
    if any(a in ("-h", "--help") for a in argv):
        print(config_help(cls, prog, allow_files, description))
        raise SystemExit(0)
    files, overrides = _split_args(cls, argv, allow_files)
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    aliases = _aliases(cls)
    # Each key is checked at its own line, before its value is read: a typo is named where it stands (with the
    # key it resembles), not at a later line that reads the key it should have set.
    check = lambda key, where: _check_key(cls, aliases[key].key if key in aliases else key, where)
    for path in files:
        lines: dict[str, int] = {}
        for key, value in read_config_file(path, fixed=overrides, check_key=check, lines=lines).items():
            where = f"{path} line {lines[key]}"
            if key in aliases:
                key, value = aliases[key].apply(value)
            _check_key(cls, key, where)
            try:
                values[key] = convert(key, hints[key], value, from_text=False)
            except ConfigError as e:  # a value of the wrong kind is named where it stands, as a wrong key is
                raise ConfigError(f"{e} (in {where})") from None
    return {**values, **overrides}


def command_line_values(cls: type, argv: list[str]) -> dict[str, Any]:
    """The values argv's --key=value options set, without its config files' (what parse_args lets win)."""
    return _split_args(cls, argv, allow_files=True)[1]


def _split_args(cls: type, argv: list[str], allow_files: bool) -> tuple[list[str], dict[str, Any]]:
    """argv's config files, and its --key=value / --key value overrides converted to the fields' types."""
    hints = typing.get_type_hints(cls)
    files: list[str] = []
    bare: list[str] = []  # the POSITIONAL field's items
    overrides: dict[str, Any] = {}
    spelled: dict[str, str] = {}  # key -> the spelling that set it (--to for --out)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--"):
            key, eq, raw = arg[2:].partition("=")
            alias = _aliases(cls).get(key)
            if not eq:  # "--key value", or a bare "--flag" for a boolean
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                if alias is None and _is_flag(hints, key):
                    if nxt is not None and nxt.lower() in _BOOL_WORDS:
                        raw, i = nxt, i + 1
                    else:
                        raw = "True"
                elif nxt is not None and not nxt.startswith("--"):
                    raw, i = nxt, i + 1
                else:
                    if alias is None:
                        _check_key(cls, key, "the command line")
                    raise ConfigError(f"--{key} needs a value: --{key}=VALUE")
            name = key
            if alias is not None:
                key, raw = alias.apply(raw)
            _check_key(cls, key, "the command line")
            value = convert(key, hints[key], raw, from_text=True)
            if key in overrides and spelled[key] != name and overrides[key] != value:
                raise ConfigError(f"--{spelled[key]} and --{name} are two spellings of {key}, given different "
                                  f"values; give one of them")
            overrides[key], spelled[key] = value, name
        elif allow_files:
            files.append(arg)
        elif _positional(cls) is not None:
            bare.append(arg)
        else:
            raise ConfigError(f"unexpected argument {arg!r}; options are written --key=value (see --help)")
        i += 1
    if bare:
        key = _positional(cls)
        if key in overrides:
            raise ConfigError(f"{key} given twice: as bare arguments and as --{spelled[key]}; give one of them")
        item = _list_item(_base_type(hints[key]))
        overrides[key] = [convert(key, item, a, from_text=True) for a in bare]
    return files, overrides


def build_config(cls: type, values: dict[str, Any]):
    """Defaults updated with `values`, then checked: allowed choices and the class' own validate()."""
    cfg = cls(**values)
    for f in fields(cls):
        choices = f.metadata.get("choices")
        value = getattr(cfg, f.name)
        if not choices or value is None:  # None: auto
            continue
        for item in value if isinstance(value, list) else [value]:
            if item not in choices:
                raise ConfigError(f"{f.name} must be one of {', '.join(map(str, choices))}; got {item!r}")
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def read_config_file(path: str, fixed: dict[str, Any] | None = None,
                     check_key: Callable[[str, str], None] | None = None,
                     lines: dict[str, int] | None = None) -> dict[str, Any]:
    """The `key = value` lines of a config file, parsed without executing it. Values may be literals, bounded
    arithmetic, and names assigned earlier in the file or in `fixed` (the command line's values): a fixed key
    keeps its value, its own line is skipped, and the lines after it read the fixed value. check_key(key, where)
    is called for each line's key before its value is evaluated (`where`: "PATH line N"), to refuse an unknown
    key at its own line. `lines`, when given, receives the line of each key's value (the last one)."""
    fixed = fixed or {}
    names, values = dict(fixed), {}
    for node in _parse_file(path).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue  # a docstring
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            raise ConfigError(f"{path} line {node.lineno}: only plain assignments `key = value` are allowed")
        key = node.targets[0].id
        if check_key is not None:
            check_key(key, f"{path} line {node.lineno}")
        if key in fixed:
            continue
        where = f"{path} line {node.lineno}, {key}"
        try:
            value = _evaluate(node.value, names, where)
        except RecursionError:
            raise ConfigError(f"{where}: the expression is nested too deeply") from None
        if isinstance(value, int) and not -INT64_LIMIT <= value < INT64_LIMIT:
            raise ConfigError(f"{where}: {_show(node.value)} is outside the 64-bit integer range")
        names[key] = values[key] = value
        if lines is not None:
            lines[key] = node.lineno
    return values


def _parse_file(path: str) -> ast.Module:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path!r} not found (config files live in configs/, e.g. configs/shakespeare.py)")
    try:
        text = p.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark, as some editors write, is dropped
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}); "
                          f"save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        return ast.parse(text, filename=str(p))
    except SyntaxError as e:
        raise ConfigError(f"{path} line {e.lineno}: syntax error: {e.msg}") from None
    except (RecursionError, MemoryError):  # what the parser raises for expressions nested thousands deep
        raise ConfigError(f"{path}: an expression is nested too deeply to parse") from None


# A config's arithmetic is bounded, so that a typo cannot hang the parser (10**10**10) or fill the memory
# ("x" * 10**9): a value's integers lie in the 64-bit range of the tensors and step counters (on the way, up to
# +-2**64, for `2**63 - 1`), strings (paths, prompts, names) under MAX_STR_LEN characters, floats are finite.
# Each bound is checked before the operation that would break it.
INT64_LIMIT = 2**63
MAX_STR_LEN = 10_000
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARYOPS = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST, names: dict[str, Any], where: str) -> Any:
    if isinstance(node, ast.Constant):
        if not isinstance(node.value, (int, float, str, type(None))):  # bool is an int
            raise ConfigError(f"{where}: values must be numbers, strings, True/False or None, not "
                              f"{_show(node)}")
        return _bounded(node.value, node, where)
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise ConfigError(f"{where}: {node.id!r} is not assigned earlier in the file nor on the command line")
        return names[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARYOPS:
        operands = [_evaluate(node.operand, names, where)]
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        operands = [_evaluate(node.left, names, where), _evaluate(node.right, names, where)]
        _check_size(node, *operands, where)
    else:
        raise ConfigError(f"{where}: values must be literals or arithmetic on numbers, not {_show(node)}")
    try:
        value = {**_BINOPS, **_UNARYOPS}[type(node.op)](*operands)
    except OverflowError:  # 10.0 ** 400
        raise ConfigError(f"{where}: {_show(node)} is outside the floating-point range") from None
    except Exception as e:  # e.g. division by zero, "a" * None
        raise ConfigError(f"{where}: cannot evaluate {_show(node)}: {e}") from None
    return _bounded(value, node, where)


def _check_size(node: ast.BinOp, left: Any, right: Any, where: str) -> None:
    """Refuse an operation whose result would break the bounds, before it is computed."""
    if isinstance(left, str) or isinstance(right, str):
        if isinstance(node.op, ast.Mult):
            text, count = (left, right) if isinstance(left, str) else (right, left)
            if isinstance(count, int) and len(text) * count > MAX_STR_LEN:
                raise ConfigError(f"{where}: {_show(node)} would be a string of {len(text) * count:,} characters; "
                                  f"at most {MAX_STR_LEN:,} are allowed")
        elif not isinstance(node.op, ast.Add):  # `%` would format ("%099999999d" % 1): strings only join, repeat
            raise ConfigError(f"{where}: cannot evaluate {_show(node)}: strings can only be joined (+) and "
                              f"repeated (*)")
    if (isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and abs(left) > 1
            and right > 64):  # |left| >= 2: over 2**64
        raise ConfigError(f"{where}: {_show(node)} is outside the 64-bit integer range")


def _bounded(value: Any, node: ast.AST, where: str) -> Any:
    if isinstance(value, int) and abs(value) > 2 * INT64_LIMIT:
        raise ConfigError(f"{where}: {_show(node)} is outside the 64-bit integer range")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: {_show(node)} is not a finite number")
    if isinstance(value, str) and len(value) > MAX_STR_LEN:
        raise ConfigError(f"{where}: a string of {len(value):,} characters; at most {MAX_STR_LEN:,} are allowed")
    return value


def _show(node: ast.AST, limit: int = 60) -> str:
    text = ast.unparse(node)
    return repr(text if len(text) <= limit else text[:limit] + "...")


_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _is_flag(hints: dict, key: str) -> bool:
    return key in hints and _base_type(hints[key]) is bool


def _list_item(tp) -> type | None:
    """list[int] -> int; None for a type that is not a list."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is list else None


def _type_name(tp) -> str:
    """What --help says a field takes: int, str, ..., or int,... for a comma list of ints."""
    base = _base_type(tp)
    item = _list_item(base)
    return f"{item.__name__},..." if item is not None else base.__name__


def _base_type(tp) -> type:
    """int | None -> int."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _check_key(cls: type, key: str, where: str) -> None:
    names = [f.name for f in fields(cls)]
    if key not in names:
        close = difflib.get_close_matches(key, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "; see --help for the valid keys"
        raise ConfigError(f"unknown config key {key!r} (in {where}){hint}")


def convert(key: str, tp, value: Any, from_text: bool) -> Any:
    """Convert a value for field `key` of type `tp`; `from_text` values come from the command line."""
    optional = _base_type(tp) is not tp
    base = _base_type(tp)
    # None means auto: written auto (or none, null) on the command line, "auto" (or None) in a file
    auto_words = ("none", "auto", "null") if from_text else ("auto",)
    if optional and (value is None or (isinstance(value, str) or from_text) and str(value).lower() in auto_words):
        return None
    item = _list_item(base)
    if item is not None:  # a comma list, "12,16,32" (in a file a string too, or one value)
        items = [v.strip() for v in value.split(",")] if isinstance(value, str) else [value]
        try:
            return [convert(key, item, v, from_text=from_text or isinstance(value, str)) for v in items]
        except ConfigError:
            raise ConfigError(f"{key} expects a comma-separated list of {item.__name__}, got {value!r}") from None
    expected = base.__name__ + (" or auto" if optional else "")
    bad = ConfigError(f"{key} expects {expected}, got {value!r}")
    if from_text:
        text = str(value).strip()
        try:
            if base is bool:
                if text.lower() not in _BOOL_WORDS:
                    raise bad
                return _BOOL_WORDS[text.lower()]
            if base is int:
                number = float(text) if any(c in text.lower() for c in ".e") else int(text)
                if isinstance(number, float) and not number.is_integer():
                    raise bad
                return _int64(key, number)
            if base is float:
                return float(text)
            return str(value)  # strings verbatim: a prompt's leading/trailing spaces matter
        except ValueError:
            raise bad from None
    # values from a config file are already Python objects: accept only the right kind
    if base is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        if isinstance(value, float) and not value.is_integer():
            raise bad
        return _int64(key, value)
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if not isinstance(value, str):
        raise bad
    return value


def _int64(key: str, number: int | float) -> int:
    if not -INT64_LIMIT <= number < INT64_LIMIT:
        raise ConfigError(f"{key} must lie in the 64-bit integer range (-2**63 to 2**63 - 1), got {number:.3g}")
    return int(number)


# ----------------------------------------------------------------------------- showing and saving


def config_help(cls: type, prog: str, allow_files: bool = True, description: str = "") -> str:
    """--help: the usage line, `description`, then a line per field and per alias (every script's, this one)."""
    files = "[CONFIG_FILE.py ...] " if allow_files else ""
    positional = _positional(cls)
    bare = f" {positional.upper()} [{positional.upper()} ...]" if positional and not allow_files else ""
    lines = [f"usage: python {prog} {files}[--key=value ...]{bare}", ""]
    if description:
        lines += [description.strip(), ""]
    lines.append("options (default, type, description):")
    hints = typing.get_type_hints(cls)
    rows = []
    for f in fields(cls):
        rows.append((f"--{f.name}={_show_default(f)}", _type_name(hints[f.name]), f.metadata.get("help", "")))
    aliases = [(f"--{name}=...", "alias", f"same as --{alias.key}: {alias.help}")
               for name, alias in _aliases(cls).items()]
    width = max(len(option) for option, _, _ in rows + aliases)
    tp_width = max(5, *(len(tp) for _, tp, _ in rows))
    lines += [f"  {option:<{width}}  {tp:<{tp_width}}  {text}" for option, tp, text in rows]
    if aliases:
        lines += ["", f"aliases ({getattr(cls, 'ALIASES_TITLE', 'other spellings')}):"]
        lines += [f"  {option:<{width}}  {tp:<{tp_width}}  {text}" for option, tp, text in aliases]
    return "\n".join(lines)


def _show_default(f) -> str:
    if f.default is not MISSING:
        return "auto" if f.default is None else str(f.default)
    if f.default_factory is not MISSING:  # a comma list's
        return ",".join(map(str, f.default_factory()))
    return "(required)"


def config_to_dict(cfg) -> dict[str, Any]:
    return asdict(cfg)


def config_to_json(cfg) -> str:
    return json.dumps(config_to_dict(cfg), indent=2)


def print_config(cfg, file=None) -> None:
    """One line per setting, on `file` (sys.stdout as it is when called: it may have been replaced since import)."""
    width = max(len(f.name) for f in fields(cfg))
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        print(f"  {f.name:<{width}} = {'auto' if value is None else value!r}", file=file or sys.stdout)
