"""README.md and BENCHMARKS.md: no placeholder left where a figure or a sentence belongs."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# A stand-in written while the figures were pending (e.g. MODERN_RATIO), or a note to come back to. Code
# (fenced blocks and `inline`) is left out: environment variables and constants are written there.
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b|\bTODO\b|\bTBD\b|\bFIXME\b|\bXXX\b|\{\{|\}\}")


def prose(text: str) -> str:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


@pytest.mark.parametrize("name", ["README.md", "BENCHMARKS.md"])
def test_no_unfilled_placeholder(name):
    found = sorted(set(PLACEHOLDER.findall(prose((REPO / name).read_text()))))
    assert not found, f"{name} holds placeholders: {found}"


def test_the_check_sees_a_placeholder():
    assert PLACEHOLDER.findall(prose("reaches 1.80 in MODERN_RATIO of its time; `GPTKIT_CACHE_DIR` is fine"))
    assert not PLACEHOLDER.findall(prose("```\nexport CUDA_VISIBLE_DEVICES=0\n```\nplain words, 1.80"))


def test_llama_server_paths_are_the_checkouts_not_a_machines():
    """The commands that run llama-server name the binary where benchmarks/llama_server.sh builds it, relative
    to the checkout (build/NAME/bin/llama-server), not a folder of the machine they were measured on."""
    texts = {name: (REPO / name).read_text() for name in ("BENCHMARKS.md", "benchmarks/serve_chat.py",
                                                          "benchmarks/serve_load.py")}
    for name, text in texts.items():
        paths = re.findall(r"--llama_server[ =]([^\s\\`\"]+)", text)
        binaries = [p for path in paths for p in path.split(",") if not p.startswith(("{", "''"))]
        assert binaries and all(re.fullmatch(r"build/[\w.-]+/bin/llama-server", p) for p in binaries), (name, binaries)
