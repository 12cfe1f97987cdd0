"""The servers the serving benchmarks measure (benchmarks/serve_load.py, benchmarks/serve_chat.py): serve.py and
llama.cpp's llama-server, each started in a subprocess on a free 127.0.0.1 port on a random-weights checkpoint
(speed does not depend on the weights), and what is read back from them. A module of the benchmarks, not a
script: nothing here runs on its own.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from gptkit.errors import UserError
from gptkit.options import read_config_file

REPO = Path(__file__).resolve().parents[1]
# A request whose connection the server closes before answering is sent again, at most this many times
# (llama-server, now and then, closes a kept-alive connection that a request is already on its way on).
RETRIES = 2
SHAKESPEARE_CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # its 65 characters


class LoadError(UserError):
    """A bad option, a URL not on this machine, a server that does not start."""


GPT2_VOCAB = 50257


def gpt2_sized_chars() -> list[str]:
    """GPT-2's number of tokens as characters: newline and the 95 printable ASCII ones, then the code points
    up from U+4E00, skipping the surrogates and U+FFFD (which a stream holds back as an unfinished character)."""
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    chars += [chr(c) for c in range(0x4E00, 0x4E00 + GPT2_VOCAB + 2048) if not 0xD800 <= c < 0xE000 and c != 0xFFFD]
    return chars[:GPT2_VOCAB]


def write_checkpoint(folder: Path, name: str, n_layer: int | None = None) -> Path:
    """Random weights in the shape of `name` (baby, gpt2 or gpt2-random; n_layer: fewer layers), saved as
    train.py saves a checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    import torch

    from gptkit.checkpoint import save_checkpoint
    from gptkit.tokenizer import Tokenizer
    from model import GPT, GPTConfig

    layers = {} if n_layer is None else {"n_layer": n_layer}
    if name in ("gpt2", "gpt2-random"):  # GPT-2 small as train.py builds it on GPT-2's BPE (or as many chars)
        spec = {"kind": "tiktoken", "name": "gpt2"} if name == "gpt2" else {"kind": "char", "chars": gpt2_sized_chars()}
        tokenizer = Tokenizer(spec)
        cfg = GPTConfig(vocab_size=tokenizer.vocab_size, vocab_multiple=64, dropout=0.0, **layers)
    else:
        shape = read_config_file(str(REPO / "configs" / "shakespeare.py"))
        tokenizer = Tokenizer({"kind": "char", "chars": list(SHAKESPEARE_CHARS)})
        cfg = GPTConfig(vocab_size=tokenizer.vocab_size, dropout=0.0,
                        **{k: shape[k] for k in ("block_size", "n_layer", "n_head", "n_embd", "bias")} | layers)
    torch.manual_seed(0)
    model = GPT(cfg)
    meta = {"format_version": 1, "tokenizer": tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size,
            "eot_id": None, "splits": {}}
    state = {"format": 1, "model_config": cfg.to_dict(), "model": model.state_dict(), "tokenizer": meta,
             "step": 0, "config": {}}
    save_checkpoint(state, folder / "best.pt")
    return folder


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM (a server's graceful stop), then SIGKILL if it has not exited within a minute."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class LocalServer:
    """serve.py in a subprocess on a free 127.0.0.1 port; its stderr goes to a file beside the checkpoint,
    printed here when it is ready and, what came after (errors, TORCH_LOGS), when it stops."""

    def __init__(self, ckpt: Path, max_batch: int, extra: list[str], timeout: float = 300):
        self.log = ckpt / "serve.log"
        self.shown = 0  # characters of the log already printed
        with open(self.log, "w") as log:
            command = [sys.executable, str(REPO / "serve.py"), f"--ckpt={ckpt}", "--port=0",
                       f"--max_batch={max_batch}", *extra]
            self.proc = subprocess.Popen(command, cwd=REPO, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_text()
            if "serve.py: serving" in text:
                line = next(x for x in text.splitlines() if x.startswith("serve.py: serving"))
                self.url = line.split("http://")[1].split()[0].removesuffix("/v1")
                self.url = "http://" + self.url
                print(text.strip(), file=sys.stderr)
                self.shown = len(text)
                return
            if self.proc.poll() is not None:
                raise LoadError(f"serve.py exited: {text.strip().splitlines()[-1] if text.strip() else '?'}")
            time.sleep(0.2)
        self.stop()
        raise LoadError(f"serve.py did not start within {timeout:.0f} s")

    def stop(self) -> None:
        stop_process(self.proc)
        rest = self.log.read_text()[self.shown :].strip()
        if rest:
            print(rest, file=sys.stderr)


class LlamaServer:
    """llama.cpp's llama-server (benchmarks/llama_server.sh builds it) in a subprocess on a free 127.0.0.1
    port, serving the checkpoint in `ckpt` exported to GGUF (gguf_type: f32, f16 or q8_0) with `slots`
    parallel sequences (-np) of the model's whole context each, and an HTTP thread for each of up to
    `http_threads` clients; its output goes to a file beside the checkpoint. Its requests ask for ignore_eos
    (serve.py's random checkpoint has no end-of-text either) and say whether to keep prompts (cache_prompt):
    false for serve_load's fresh prompts, true for serve_chat.py's conversations."""

    def __init__(self, binary: str, ckpt: Path, gguf_type: str, slots: int, extra: list[str],
                 http_threads: int = 0, timeout: float = 300):
        import socket
        import urllib.request

        from gptkit.checkpoint import load_checkpoint
        from gptkit.gguf import export_gguf
        from model import GPT, GPTConfig

        state = load_checkpoint(ckpt / "best.pt")
        model = GPT(GPTConfig.from_dict(state["model_config"]))
        model.load_state_dict(state["model"])
        path = ckpt / f"model-{gguf_type}.gguf"
        export_gguf(model, path, state["tokenizer"], dtype=gguf_type, overwrite=True)
        with socket.socket() as sock:  # a free port (llama-server cannot take port 0 and say which it got)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url, self.log = f"http://127.0.0.1:{port}", ckpt / "llama-server.log"
        with open(self.log, "w") as log:
            # An HTTP thread for each client: its default (-np + 2 here) drops connections beyond them under
            # 64 clients ("Server disconnected without sending a response").
            command = [binary, "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
                       "-c", str(slots * model.config.block_size), "-a", f"llama-server-{gguf_type}",
                       "--threads-http", str(max(http_threads, slots + 2)), *extra]
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:  # not listening yet, or 503 while it loads
                pass
            if self.proc.poll() is not None:
                raise LoadError(f"llama-server exited: see {self.log}: {self.log.read_text()[-300:]}")
            time.sleep(0.5)
        self.stop()
        raise LoadError(f"llama-server did not start within {timeout:.0f} s")

    def stop(self) -> None:
        stop_process(self.proc)


def check_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.hostname != "127.0.0.1" or parts.port is None:
        raise LoadError(f"--url {url!r}: only a server on this machine, http://127.0.0.1:PORT")
    return f"http://127.0.0.1:{parts.port}"


def served_model(url: str) -> str:
    import openai

    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30) as client:
        return client.models.list().data[0].id


def prefix_metrics(url: str) -> dict[str, float] | None:
    """serve.py's /metrics, by name without the gptkit_ (None from a server without them: llama-server's)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
            body = response.read().decode()
    except OSError:
        return None
    values = {}
    for line in body.splitlines():
        if line.startswith("gptkit_"):
            name, value = line.split()
            values[name.removeprefix("gptkit_")] = float(value)
    return values or None


# ----------------------------------------------------------------------------- the clients (serve_load.py's)

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, "


@dataclass
class Result:
    tokens: int
    first_token_s: float | None  # None: no text came
    retries: int = 0  # connections closed before any answer, and the request sent again




SERIALS = itertools.count(1000)  # every request's prompt starts with a number of its own


def fresh_prompt(letters: bool = False) -> str:
    """PROMPT after a number no other request of the run had: a fresh prompt, which no server has computed
    before (serve.py keeps prompts' keys and values; numbers from 1000 are mostly one GPT-2 token each, so
    two prompts share at most a first token or two: serve.py's /metrics, printed at the end, says how many).
    letters: the number in base 26 written a-z (for the baby model, whose 65 characters have one digit)."""
    serial = next(SERIALS)
    if letters:
        digits = ""
        while serial:
            serial, d = divmod(serial, 26)
            digits = chr(ord("a") + d) + digits
        return f"{digits} {PROMPT}"
    return f"{serial} {PROMPT}"


async def one_request(client, model: str, max_tokens: int, seed: int, extra: dict | None = None,
                      letters: bool = False) -> Result:
    """One streamed completion of a fresh prompt; its time to first token counts from the first attempt. A
    connection the server closes before answering (llama-server, now and then, on a new connection right
    after a level of many clients ends) is retried, at most RETRIES times: nothing was computed for it."""
    import openai

    start = time.perf_counter()
    first, tokens, pieces = None, None, 0
    prompt = fresh_prompt(letters)
    for attempt in range(RETRIES + 1):
        try:
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=1.0, seed=seed, stream=True,
                                                     stream_options={"include_usage": True}, extra_body=extra)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    first = first if first is not None else time.perf_counter() - start
                    pieces += 1
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            break
        except openai.APIConnectionError:
            if pieces or tokens is not None or attempt == RETRIES:
                raise
    return Result(pieces if tokens is None else tokens, first, attempt)  # (a server without usage: its pieces)


async def run_level(url: str, model: str, clients: int, requests: int, seconds: float,
                    max_tokens: int, extra: dict | None = None, timeout: float = 600, min_seconds: float = 0,
                    letters: bool = False) -> tuple[list[Result], float]:
    """`clients` clients, each sending `requests` requests one after another, and more until the level has run
    min_seconds (whichever is longer: a level of ~1 s of work moves by 20% with one scheduler hiccup); none
    new after `seconds`. The results and the level's wall time."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout)
    results: list[Result] = []
    start = time.perf_counter()

    async def worker(w: int) -> None:
        r = 0
        while r < requests or time.perf_counter() - start < min_seconds:
            if time.perf_counter() - start > seconds:
                return
            results.append(await one_request(client, model, max_tokens, seed=w * 100000 + r, extra=extra,
                                             letters=letters))
            r += 1

    try:
        await asyncio.gather(*(worker(w) for w in range(clients)))
    finally:
        await client.close()
    return results, time.perf_counter() - start
