"""What README.md says, checked against what the code does: the chat client's example fits the models the README
builds, the set-up installs PyTorch's CPU wheel from PyTorch's index, which tokenizers carry the chat markers,
what Ctrl-C does in chat.py, and the `--plan` samples."""

import ast
import builtins
import io
import re
import sys
from pathlib import Path

import pytest
from conftest import needs_gpt2_bpe, torch_threads, train_script

import chat
from gptkit.chat import prompt_ids
from gptkit.checkpoint import save_checkpoint
from gptkit.options import read_config_file
from gptkit.prepare.conversations import chat_tokenizer
from gptkit.tokenizer import CHAT_SPECIALS, Tokenizer
from model import GPT, GPTConfig
from prepare import chat as prepare_chat
from prepare import tokenizer as prepare_tokenizer

train = train_script()

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    start = README.index(f"\n## {title}")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def paragraph(starting: str) -> str:
    """The README's paragraph that starts with `starting`, on one line."""
    start = README.index(starting)
    return " ".join(README[start:README.find("\n\n", start)].split())


def streaming_request() -> tuple[int, list[dict]]:
    """The max_tokens and the messages of the README's streaming call to serve.py."""
    snippet = re.findall(r"```python\n(.*?)```", section("Chat: from a base model to an assistant"), flags=re.S)[0]
    call = re.search(r"stream=True, max_tokens=(\d+),\s*messages=(\[.*?\])\)", snippet, flags=re.S)
    return int(call.group(1)), ast.literal_eval(call.group(2))


def test_the_streaming_example_fits_a_chat_model_of_the_cpu_quick_starts_context():
    # A chat model fine-tuned from the CPU quick start's keeps its 64 tokens: the prompt (the template around
    # the message, as serve.py renders it) and max_tokens must fit there, or serve.py refuses the request.
    context = read_config_file(str(REPO / "configs" / "shakespeare_cpu.py"))["block_size"]
    max_tokens, messages = streaming_request()
    chars = sorted(set("".join(m["content"] for m in messages)) | {"\n"})
    tokenizer = Tokenizer({"kind": "char", "chars": chars}).with_special(CHAT_SPECIALS)
    assert len(prompt_ids(messages, tokenizer)) + max_tokens <= context == 64


@needs_gpt2_bpe
def test_the_streaming_example_fits_a_gpt2_chat_model_of_that_context():
    max_tokens, messages = streaming_request()
    tokenizer = Tokenizer.tiktoken("gpt2").with_special(CHAT_SPECIALS)
    assert len(prompt_ids(messages, tokenizer)) + max_tokens <= 64


def test_the_set_up_gives_pytorchs_cpu_index_and_ci_keeps_its_local_wheel():
    block = re.findall(r"```bash\n(.*?)```", section("Set up"), flags=re.S)[0]
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in block
    assert block.index("download.pytorch.org/whl/cpu") < block.index('pip install -e ".[dev]"')  # torch first
    ci = (REPO / ".ci" / "run").read_text()
    assert 'setup "$work/newest" 2.13.0' in ci and '"torch==$2"' in ci and "--index-url" not in ci


def test_the_set_up_makes_an_environment_and_names_what_each_extra_adds():
    """A virtual environment first; `pip install -e .` to use it, `.[serve]` for serve.py, `.[dev]` for the tests:
    what the README says each extra adds is what pyproject.toml's extras hold."""
    tomllib = pytest.importorskip("tomllib")
    block = re.findall(r"```bash\n(.*?)```", section("Set up"), flags=re.S)[0]
    order = [block.index(s) for s in ("python -m venv", "pip install -e .  ", 'pip install -e ".[serve]"',
                                      'pip install -e ".[dev]"', "python -m pytest")]
    assert order == sorted(order)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {k: {re.split(r"[\[<>=]", d)[0] for d in v} for k, v in extras.items()}
    text = paragraph("Pick one of the three installs")
    assert names["serve"] == {"starlette", "uvicorn", "pydantic"} and "`.[serve]` adds Starlette, uvicorn and pydantic" in text
    assert names["serve"] <= names["dev"]  # "serve.py's packages"
    said = {"pytest": "pytest", "pytest-xdist": "pytest-xdist", "ruff": "ruff", "transformers": "transformers",
            "openai": "`openai` client", "lm-eval": "lm-evaluation-harness", "selenium": "selenium"}
    assert names["dev"] - names["serve"] - {"setuptools"} == set(said) and all(w in text for w in said.values())
    assert names["llama"] == {"llama-cpp-python"} and "`.[llama]` adds llama-cpp-python" in text


def test_the_plan_samples_are_what_plan_prints_now(tmp_path, monkeypatch, capsys):
    """The README's `--plan` output is the command's, run here, line for line but for the row of the CPU at
    hand (its RAM and cores are this machine's). Run from a folder without prepared data, as the samples were."""
    samples = re.findall(r"```\n(plan: train\.py .*?)```", README, flags=re.S)
    assert len(samples) == 2
    (tmp_path / "configs").symlink_to(REPO / "configs")
    monkeypatch.chdir(tmp_path)

    def lines(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith("  this CPU (")]

    for sample in samples:
        argv = sample.splitlines()[0].removeprefix("plan: train.py ").split()
        train.main([*argv, "--plan"])
        assert lines(capsys.readouterr().out) == lines(sample)


def test_only_prepare_chat_py_adds_the_chat_markers_as_the_readme_says(tmp_path):
    text = paragraph("A tokenizer can carry named special tokens")
    assert "GPT-2's BPE has `<|endoftext|>` alone, a character vocabulary none" in text
    assert "The chat markers come with `prepare/chat.py`, which adds those its tokenizer lacks" in text
    assert "reserves all five by default (`--special`)" in text
    assert Tokenizer({"kind": "char", "chars": list("abc")}).special == {}
    conversations = tmp_path / "c.jsonl"
    conversations.write_text('{"messages": [{"role": "user", "content": "abc"}]}\n')
    char = chat_tokenizer("char", lambda: prepare_chat.conversation_chars(conversations), str(tmp_path))
    assert list(char.special) == list(CHAT_SPECIALS)  # added by prepare/chat.py, after the characters
    assert tuple(prepare_tokenizer.TokenizerConfig().special) == CHAT_SPECIALS


@needs_gpt2_bpe
def test_gpt2s_bpe_gets_the_chat_markers_from_prepare_chat_py_only(tmp_path):
    assert Tokenizer.tiktoken("gpt2").special == {"<|endoftext|>": 50256}
    gpt2 = chat_tokenizer("gpt2", lambda: prepare_chat.conversation_chars(tmp_path / "unused.jsonl"), str(tmp_path))
    assert gpt2.special == {"<|endoftext|>": 50256, "<|system|>": 50257, "<|user|>": 50258, "<|assistant|>": 50259,
                            "<|end|>": 50260}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_ctrl_c_at_chats_prompt_ends_it_with_code_0_as_the_readme_says(tmp_path, monkeypatch, capsys):
    text = paragraph("**chat.py** streams each reply")
    assert "Ctrl-C while a reply is being written stops that reply, not the program" in text
    assert "at the prompt, Ctrl-C, like Ctrl-D and `/quit`, ends chat.py (exit code 0)" in text
    tokenizer = Tokenizer({"kind": "char", "chars": list("abc \n")}).with_special(CHAT_SPECIALS)
    cfg = GPTConfig(block_size=16, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=1, n_embd=8)
    meta = {"tokenizer": tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
            "splits": {}}
    save_checkpoint({"format": 1, "model_config": cfg.to_dict(), "model": GPT(cfg).state_dict(), "tokenizer": meta,
                     "step": 1, "config": {}}, tmp_path / "out" / "best.pt")

    prompts = []

    def ctrl_c(prompt=""):
        prompts.append(prompt)
        raise KeyboardInterrupt

    monkeypatch.setattr(sys, "stdin", Terminal())
    monkeypatch.setattr(builtins, "input", ctrl_c)
    with torch_threads(1):  # a Ctrl-C that escaped would be "interrupted" and exit code 1 (a SystemExit)
        assert chat.main([f"--ckpt={tmp_path / 'out'}", "--device=cpu"]) is None
    assert prompts == ["you> "] and "error" not in capsys.readouterr().err


def test_the_headline_ratios_are_benchmarks_reproduce_claims_word_for_word():
    """The README's and BENCHMARKS.md's headline comparisons quote benchmarks/reproduce.py's CLAIMS, the one
    place their figures are kept (reproduce.py checks them against a new measurement), each with its range;
    where ranges overlap the text says "at parity"; the old single-run ratios are gone."""
    from benchmarks.reproduce import CLAIMS

    readme = " ".join(README.split())
    benchmarks = " ".join((REPO / "BENCHMARKS.md").read_text(encoding="utf-8").split())
    for claim in CLAIMS:
        assert claim.text in readme, f"README.md does not quote {claim.key}: {claim.text!r}"
        assert claim.text in benchmarks, f"BENCHMARKS.md does not quote {claim.key}: {claim.text!r}"
        said = [float(f) for f in re.findall(r"\d+\.\d+", claim.text)]  # the text says the claim's range
        assert said[-2:] == [claim.low, claim.high] or said[-1:] == [claim.low] == [claim.high], claim.key
    serving = paragraph("Measured on this 2-core CPU")
    assert "**at parity** with llama-server, not ahead" in serving and "2.18x its" not in readme
    assert "at parity" in paragraph("Decoding on a 2-core CPU")
