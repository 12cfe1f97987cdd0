"""The shape of the code: imports point down (scripts -> gptkit -> model.py). Every module's imports are read,
those inside functions included, and none may close a circle or import a script (train.py, sample.py, ...,
prepare/*.py, benchmarks/*.py). The one exception is model.py's nanoGPT-style API: GPT.from_pretrained and
GPT.generate import gptkit.hf_gpt2 and gptkit.generate inside the call. Also: the parser's names are imported
from gptkit.options, where they are defined, not through gptkit.config; the error types from gptkit.errors.

The levels: a module stands one level above the highest module it imports (level 0 imports nothing of ours),
so the number of levels is the longest chain of imports. config.py stands below every feature it configures
(it reaches none of them). `python tests/test_imports.py` prints each module's level."""

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# model.py's delegates: (function, the module it imports inside it), the one allowed upward import.
MODEL_DELEGATES = {("from_pretrained", "gptkit.hf_gpt2"), ("generate", "gptkit.generate")}


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A file's syntax tree, read once per test run (several tests walk every file). Not modified by callers."""
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def modules(root: Path) -> dict[str, Path]:
    """Every Python file of the project outside tests/, by module name (a package by its __init__.py). Not
    benchmarks/gpu/ (what each GPU run left: records, a probe among them, not code) nor shared/ (the shared data,
    copied into the checkout for a GPU machine; git ignores it)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if (rel.parts[0] in ("tests", "build", "dist", "shared") or rel.parts[:2] == ("benchmarks", "gpu")
                or any(p.startswith(".") for p in rel.parts)):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts:
            found[".".join(parts)] = path
    return found


def scripts(known: dict[str, Path], root: Path) -> set[str]:
    """What a user runs: the files at the top (model.py aside), and those of prepare/ and benchmarks/ that run as
    a program (`if __name__ == "__main__":`; benchmarks/servers.py, say, is the serving benchmarks' module)."""
    return {name for name, path in known.items() if path.name != "__init__.py" and name != "model"
            and (path.parent == root or (path.parent.relative_to(root).parts in (("prepare",), ("benchmarks",))
                                         and '__name__ == "__main__"' in path.read_text(encoding="utf-8")))}


def imports(path: Path, name: str, known: dict[str, Path]) -> list[tuple[str, str | None, int]]:
    """(imported project module, the function it is imported in or None, line) for every import of `path`,
    at the top or inside a function or method. `from a import b` imports a.b when that is a module, else a;
    importing a package's module also runs the package (unless the importer is inside it)."""
    tree = parsed(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def add(target: str, where: str | None, line: int) -> None:
        parts = target.split(".")
        for i in range(1, len(parts)):  # the packages on the way
            parent = ".".join(parts[:i])
            if parent in known and not (name == parent or name.startswith(parent + ".")):
                found.append((parent, where, line))
        if target in known:
            found.append((target, where, line))

    def visit(node: ast.AST, where: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, where, child.lineno)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the importer's package
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in child.names:
                    full = f"{base}.{alias.name}" if base else alias.name
                    add(full if full in known else base, where, child.lineno)
            visit(child, inner)

    visit(tree, None)
    return found


def delegate(where: str | None, target: str) -> bool:
    """Whether model.py importing `target` inside function `where` is one of its delegates' imports (the module,
    or the package it runs on the way)."""
    return any(where == f and (target == m or m.startswith(target + ".")) for f, m in MODEL_DELEGATES)


def import_graph(root: Path) -> tuple[dict[str, set[str]], list[str]]:
    """The project's import edges (model.py's delegates left out) and the imports of a script, as lines."""
    known = modules(root)
    runnable = scripts(known, root)
    graph: dict[str, set[str]] = {n: set() for n in known}
    of_scripts = []
    for name, path in known.items():
        for target, where, line in imports(path, name, known):
            if name == "model" and delegate(where, target):
                continue
            if target == name:
                continue
            graph[name].add(target)
            if target in runnable:
                of_scripts.append(f"{path.relative_to(root)}:{line} imports the script {target}")
    return graph, of_scripts


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: every strongly connected group of more than one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return groups


def levels(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's level: 0 when it imports nothing of the project, else one above the highest module it
    imports. (The graph has no circle: test_no_import_circle_and_no_module_imports_a_script.)"""
    level: dict[str, int] = {}

    def of(name: str) -> int:
        if name not in level:
            level[name] = max((of(target) + 1 for target in graph[name]), default=0)
        return level[name]

    for name in graph:
        of(name)
    return level


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module importing `start` runs, directly or through others (start itself aside)."""
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen - {start}


def level_map(root: Path = REPO) -> str:
    """The modules by level, one line a level (the design map's "which level each module stands on")."""
    graph, _ = import_graph(root)
    by_level: dict[int, list[str]] = {}
    for name, level in levels(graph).items():
        by_level.setdefault(level, []).append(name)
    return "\n".join(f"{level:2d}  {'  '.join(sorted(by_level[level]))}" for level in sorted(by_level))


# The longest chain of imports was 15 levels when the error types and the features' settings lived in the
# modules that raise and use them (config.py on level 6, parallel.py importing plan.py); fewer is the rule now.
MAX_LEVELS = 14
# What config.py configures: it declares their settings (gptkit/settings.py holds the objects) and imports none.
CONFIGURED = ("gptkit.objectives", "gptkit.lora", "gptkit.generate", "gptkit.inference",
              "gptkit.runtime", "gptkit.threads", "gptkit.cpu_decode")


def test_the_import_chains_are_short_and_config_stands_below_the_features():
    graph, _ = import_graph(REPO)
    level = levels(graph)
    assert max(level.values()) + 1 <= MAX_LEVELS, level_map()
    configured = {name for name in graph if name.startswith(CONFIGURED)}
    assert {"gptkit.objectives", "gptkit.lora", "gptkit.generate", "gptkit.runtime"} <= configured  # (the names exist)
    for low in ("gptkit.config", "gptkit.settings", "gptkit.options", "gptkit.errors"):
        assert sorted(reached(graph, low) & configured) == [], f"{low} imports what it configures"
        assert all(level[low] < level[name] for name in configured if low in reached(graph, name))


def test_no_two_modules_of_the_package_share_a_name():
    """Inside gptkit/ each module (or subpackage) has its own name, so that a name in a traceback or an import
    says which file it is (the scripts' names, train.py or prepare/chat.py, are the users' commands)."""
    by_name: dict[str, list[str]] = {}
    for name in modules(REPO):
        if name.startswith("gptkit."):
            by_name.setdefault(name.rpartition(".")[2], []).append(name)
    assert {n: sorted(found) for n, found in by_name.items() if len(found) > 1} == {}


def test_no_import_circle_and_no_module_imports_a_script():
    graph, of_scripts = import_graph(REPO)
    assert circles(graph) == []
    assert of_scripts == []


def test_model_py_imports_nothing_of_ours_but_its_two_delegates():
    """model.py stands on its own: at its top it imports nothing of the project, and inside functions only
    the nanoGPT-API delegates (which the graph above leaves out)."""
    known = modules(REPO)
    found = imports(REPO / "model.py", "model", known)
    assert {(where, target) for target, where, _ in found} >= MODEL_DELEGATES  # (the walker finds them)
    assert [(where, target) for target, where, _ in found if not delegate(where, target)] == []


def test_the_check_sees_imports_inside_functions_and_circles(tmp_path):
    """The walker itself, on a made-up project: a circle closed by an import inside a method, through a
    package's __init__, and a library module that imports a script are all found."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "__init__.py").write_text("from lib import a\n")
    (tmp_path / "lib" / "a.py").write_text("import os\nfrom lib.b import thing\n")
    (tmp_path / "lib" / "b.py").write_text("class C:\n    def m(self):\n        from lib import a\n")
    (tmp_path / "lib" / "c.py").write_text("def f():\n    import run\n")
    (tmp_path / "lib" / "d.py").write_text("from lib import b\n")
    (tmp_path / "run.py").write_text("from lib import d\n")
    graph, of_scripts = import_graph(tmp_path)
    assert circles(graph) == [["lib.a", "lib.b"]]
    assert graph["run"] == {"lib", "lib.d"}  # importing lib.d runs lib/__init__.py first
    assert of_scripts == ["lib/c.py:2 imports the script run"]
    graph["lib.b"].clear()  # the circle opened: lib.b imports nothing then; lib.c (importing run) stands on top
    assert levels(graph) == {"lib.b": 0, "lib.a": 1, "lib.d": 1, "lib": 2, "run": 3, "lib.c": 4}
    assert reached(graph, "run") == {"lib", "lib.a", "lib.b", "lib.d"}


def options_names() -> set[str]:
    tree = ast.parse((REPO / "gptkit" / "options.py").read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("_")}


@pytest.mark.parametrize("path", sorted(modules(REPO).values()), ids=lambda p: str(p.relative_to(REPO)))
def test_the_parsers_names_come_from_gptkit_options(path):
    parser = options_names()
    rel = str(path.relative_to(REPO))
    through_config = [alias.name for node in ast.walk(parsed(path))
                      if isinstance(node, ast.ImportFrom) and node.module == "gptkit.config"
                      for alias in node.names if alias.name in parser]
    assert through_config == [], f"{rel}: import {', '.join(through_config)} from gptkit.options"


def test_every_script_fails_the_one_way():
    """One CLI story: every script's main is wrapped by cli.entry_point (a user error is one `error:` line and
    exit 1) and parses with the typed parser or cli.ArgumentParser, never a bare argparse.ArgumentParser (whose
    errors are a usage dump and exit 2)."""
    known = modules(REPO)
    problems = []
    for name in sorted(scripts(known, REPO)):
        path = known[name]
        tree = parsed(path)
        mains = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "main"]
        wrapped = any(ast.unparse(d).startswith("cli.entry_point") for f in mains for d in f.decorator_list)
        bare = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
                and ast.unparse(n.func) in ("argparse.ArgumentParser", "ArgumentParser")]
        if not wrapped:
            problems.append(f"{path.relative_to(REPO)}: main is not wrapped by cli.entry_point")
        if bare:
            problems.append(f"{path.relative_to(REPO)}:{bare[0]}: a bare argparse.ArgumentParser (cli.ArgumentParser)")
    assert problems == []


def error_names() -> set[str]:
    """The error types gptkit/errors.py defines."""
    tree = ast.parse((REPO / "gptkit" / "errors.py").read_text(encoding="utf-8"))
    return {node.name for node in tree.body if isinstance(node, ast.ClassDef)}


def test_errors_stand_at_the_bottom_and_are_imported_from_there():
    """gptkit/errors.py imports nothing of the project, so any module can import an error type without pulling in
    the module that raises it; and every module imports those types from gptkit.errors, not through another
    module that happens to import them (gptkit.cli, gptkit.data.shards, ...), so no module stands above one it only
    needs for an exception."""
    known = modules(REPO)
    assert imports(REPO / "gptkit" / "errors.py", "gptkit.errors", known) == []
    errors = error_names()
    assert {"UserError", "UsageError", "ConfigError", "DataError"} <= errors
    through_others = []
    for path in [*modules(REPO).values(), *sorted((REPO / "tests").glob("*.py"))]:
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module != "gptkit.errors":
                names = sorted(alias.name for alias in node.names if alias.name in errors)
                if names and node.module.split(".")[0] in ("gptkit", "model"):
                    through_others.append(f"{path.relative_to(REPO)}:{node.lineno} imports {', '.join(names)} "
                                          f"from {node.module}")
    assert through_others == []


if __name__ == "__main__":
    print(level_map())
