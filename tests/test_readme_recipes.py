"""README.md's chat recipe and its preference-tuning recipe, run as they are written, on small files.

The commands are read from the README's "Chat" section, not copied here: what a user types is what runs, with
two changes that only save time and ports. The network is faked: the recipe's `init_from = "gpt2"` gets a tiny
GPT-2 (GPT-2's vocabulary and context, 2 layers of width 16) from a local folder instead of the Hub. And the
training command gets --max_iters=TRAIN_STEPS and --eval_iters=1 appended: the recipe's 200 steps (and its
evaluations' 10 batches) each take seconds on a CPU (a 50,257-token softmax per token, whatever the model's
width), and every step (every batch) runs the same code. prepare,
train and chat run in this process (in a scratch folder holding the conversations and a link to configs/);
serve.py runs as its own process, on a free port instead of 8000 (another test may hold that one), and the
README's Python snippet talks to it with its own max_tokens.
"""

import io
import json
import os
import random
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import needs_gpt2_bpe, torch_threads, train_script

REPO = Path(__file__).resolve().parents[1]
WAIT = 120  # seconds: the bound on waiting for the server
TRAIN_STEPS = 2  # per training command: a step past the first, then the last evaluation and checkpoint


def readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def code_blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def commands(block: str) -> list[list[str]]:
    """The block's command lines as argv lists (comments dropped)."""
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


WORDS = ["crown", "king", "queen", "lord", "sword", "rose", "night", "star"]


def write_conversations(path: Path, n: int = 450, seed: int = 0) -> Path:
    """A small file of conversations in the chat APIs' format, spelling words backwards: 450 make ~4,500
    tokens, a little more than prepare/chat.py's least (a val split of a few hundred)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            word = rng.choice(WORDS)
            messages = [{"role": "user", "content": f"spell {word} backwards"},
                        {"role": "assistant", "content": word[::-1]}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> Path:
    """A Hugging Face GPT-2 folder (config.json, model.safetensors) as the Hub's gpt2 has it, its vocabulary and
    1024 positions, but 2 layers of width 16."""
    import torch

    from export import export_hf
    from model import GPT, GPTConfig

    folder = tmp_path_factory.mktemp("tiny-gpt2") / "gpt2"
    torch.manual_seed(0)
    export_hf(GPT(GPTConfig(block_size=1024, vocab_size=50257, n_layer=2, n_head=2, n_embd=16, bias=True)), folder)
    return folder


def serve(argv: list[str], cwd: Path) -> tuple[subprocess.Popen, str, list[str]]:
    """serve.py with the README's arguments in its own process, on a free port: the process, its URL, its
    stderr lines so far (drained all along)."""
    argv = ["0" if a == "8000" else a for a in argv]  # --port 8000 -> a free port
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(REPO / argv[0]), *argv[1:]], cwd=cwd, env=env,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("serve.py: serving"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + WAIT
    while not ready.wait(0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"serve.py did not start: {''.join(lines)}")
    line = next(x for x in lines if x.startswith("serve.py: serving"))
    url = "http://" + line.split("http://")[1].split()[0].removesuffix("/v1")
    return proc, url, lines


def write_pairs(path: Path, n: int = 300, seed: int = 0) -> Path:
    """Preference pairs in the README's layout for the same task: the word spelled backwards (chosen) against the
    word as it is (rejected)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            word = rng.choice(WORDS)
            f.write(json.dumps({"prompt": f"spell {word} backwards", "chosen": word[::-1], "rejected": word}) + "\n")
    return path


@needs_gpt2_bpe
def test_the_chat_recipe_then_the_preference_recipe_run_as_written(tmp_path, monkeypatch, capsys, tiny_gpt2):
    """The chat recipe's four commands (prepare, fine-tune, chat.py, serve.py with the README's Python snippet),
    then the preference recipe's four on the chat recipe's out-chat/: pairs in out-chat/'s tokens, DPO into
    out-dpo/ (its reference precomputed), eval.py against out-chat/, and chat.py on the tuned model. One test:
    the preference recipe starts where the chat recipe's fine-tune ends (its first two commands), so that
    fine-tune runs once. Each training command with --max_iters=TRAIN_STEPS and --eval_iters=1 appended."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    import chat
    import eval as eval_script
    train = train_script()
    from gptkit import hf_gpt2
    from gptkit.checkpoint import load_checkpoint
    from prepare import chat as prepare_chat
    from prepare import preference

    section = readme_section("Chat: from a base model to an assistant")
    blocks = code_blocks(section, "bash")
    steps = commands(blocks[0])
    assert [s[:2] for s in steps] == [["python", "prepare/chat.py"], ["python", "train.py"],
                                      ["python", "chat.py"], ["python", "serve.py"]]
    prepare_argv, train_argv, chat_argv = (s[2:] for s in steps[:3])
    dpo_steps = commands(next(b for b in blocks if "configs/dpo_chat.py" in b))
    assert [s[:2] for s in dpo_steps] == [["python", "prepare/preference.py"], ["python", "train.py"],
                                          ["python", "eval.py"], ["python", "chat.py"]]

    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    write_conversations(tmp_path / prepare_argv[prepare_argv.index("--input") + 1])
    write_pairs(tmp_path / dpo_steps[0][dpo_steps[0].index("--input") + 1])
    # the Hub's gpt2, offline: the tiny folder's files
    monkeypatch.setattr(hf_gpt2, "_download", lambda repo, filename, name: tiny_gpt2 / filename)

    # The chat recipe.
    with torch_threads(1):
        prepare_chat.main(prepare_argv)
        summary = train.main([*train_argv, f"--max_iters={TRAIN_STEPS}", "--eval_iters=1"])
        out = capsys.readouterr().out
        assert "this fine-tune uses block_size=" in out  # a small file: the longest window it holds
        assert "checkpoints in out-chat/" in out
        ckpt = load_checkpoint(tmp_path / "out-chat" / "best.pt")
        assert summary["step"] == TRAIN_STEPS and ckpt["config"]["init_from"] == "gpt2"
        context = ckpt["model_config"]["block_size"]

        # chat.py from a pipe: each line a message, each reply a block of text, exit 0
        monkeypatch.setattr(sys, "stdin", io.StringIO("spell crown backwards\nand king?\n"))
        chat.main(chat_argv)
        assert capsys.readouterr().out.count("\n\n") == 2

    # serve.py, and the README's Python snippet against it (its max_tokens must fit the model's context)
    snippet = code_blocks(section, "python")[0]
    max_tokens = int(re.search(r"max_tokens=(\d+)", snippet).group(1))
    assert max_tokens + 16 <= context  # room for the snippet's short prompt
    proc, url, lines = serve(steps[3][1:], tmp_path)
    try:
        namespace: dict = {}
        exec(compile(snippet.replace("http://127.0.0.1:8000", url), "README.md", "exec"), namespace)
    finally:
        proc.terminate()
        proc.wait(timeout=WAIT)
    assert proc.returncode == 0, "".join(lines)

    # The preference recipe, on the fine-tune above.
    with torch_threads(1):
        preference.main(dpo_steps[0][2:])
        capsys.readouterr()
        summary = train.main([*dpo_steps[1][2:], f"--max_iters={TRAIN_STEPS}", "--eval_iters=1"])
        out = capsys.readouterr().out
        assert "objective: DPO (sigmoid loss, beta 0.1, + 0.5 x the chosen replies' NLL per token)" in out
        assert "checkpoints in out-dpo/" in out and summary["step"] == TRAIN_STEPS
        ckpt = load_checkpoint(tmp_path / "out-dpo" / "last.pt")
        assert ckpt["config"]["objective"] == "dpo" and "dpo_reference" in ckpt

        eval_script.main(dpo_steps[2][2:])
        scores = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert scores["task"] == "preference" and scores["pairs"] > 0 and scores["against"].startswith("reference")

        monkeypatch.setattr(sys, "stdin", io.StringIO("spell crown backwards\n"))
        chat.main(dpo_steps[3][2:])
        assert capsys.readouterr().out.count("\n\n") == 1
