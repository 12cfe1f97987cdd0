"""Serve a model over HTTP with the OpenAI API, to many clients at once.

    python serve.py --ckpt out-chat/ --port 8000          # http://127.0.0.1:8000/v1
    python serve.py --init_from gpt2 --max_batch 32       # GPT-2 as a text-completion model
    python serve.py --ckpt out-chat/ --host 0.0.0.0 --api_key=SECRET   # reachable from other machines

Any OpenAI client then talks to it (base_url http://127.0.0.1:8000/v1, any api_key unless --api_key is set): /v1/models,
/v1/completions, /v1/chat/completions (for a model with the chat tokens: train.py on prepare/chat.py's data),
streamed or not; GET /health says how busy it is; a browser at http://127.0.0.1:8000/ gets a chat page
(gptkit/serving/page.html). gptkit/serving/routes.py has the API (what is supported, the errors),
gptkit/serving/engine.py decodes the requests together: a request joins the running batch between two decode
steps and leaves it when done, so clients do not wait for each other.

On a GPU the decode step is compiled at start (--compile, auto: where torch.compile can run): a few static steps
over buckets of rows and cache slots, each a CUDA graph, the smallest that holds the live requests replayed
every token; the first start takes tens of seconds (more with a larger --max_batch).

Web pages other than the server's own cannot call it (their Origin is refused, and on 127.0.0.1 so is any Host
but its address: gptkit/serving/access.py) unless --allowed_origins or --allowed_hosts name them; --api_key (or
the GPTKIT_API_KEY variable) asks every /v1 request for "Authorization: Bearer KEY", and the chat page for the
key once.

A prompt that starts with tokens the server has computed before (a conversation sends its history again with
every message; many clients, one system message) computes only the rest: the keys and values of prompts and
finished replies are kept in memory, up to --prefix_cache MiB, least recently used out first (GET /metrics:
hit rate, tokens reused, memory held; each reply's usage.prompt_tokens_details.cached_tokens).

A full queue (--max_batch rows decoding, --max_queue waiting) answers 429 at once. SIGTERM or Ctrl-C stops
accepting connections, finishes the replies in flight, and exits with code 0 (a second Ctrl-C: at once).
Needs the optional packages of `pip install -e ".[serve]"` (Starlette, uvicorn and pydantic).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from gptkit import checkpoint, cli
from gptkit.chat import ChatError, ChatTokens
from gptkit.config import DecodeSettings
from gptkit.errors import ConfigError, UserError
from gptkit.inference import setup_inference
from gptkit.options import load_config, setting
from gptkit.serving.access import is_unspecified
from gptkit.serving.engine import Engine


class ServeError(UserError):
    """The server cannot start: packages missing, the address taken."""


@dataclass
class ServeConfig(DecodeSettings):
    # what to serve
    model_name: str = setting("", "the model's id in the API (/v1/models, the requests' 'model'); default: "
                                  "the checkpoint's folder name, or the --init_from name")
    # where
    host: str = setting("127.0.0.1", "address to listen on; 127.0.0.1 serves this machine only, 0.0.0.0 "
                                     "every network (then set --api_key)")
    port: int = setting(8000, "TCP port; 0 = any free one (the line on stderr says which)")
    # who may call it (gptkit/serving/access.py)
    api_key: str = setting("", "the key every /v1 request must send ('Authorization: Bearer KEY', an OpenAI "
                               "client's api_key); '' = none, or the GPTKIT_API_KEY environment variable's")
    allowed_origins: list[str] = setting([], "web pages other than the server's own that may call it, "
                                             "origins (http://localhost:3000), or * for any; they get CORS headers")
    allowed_hosts: list[str] = setting([], "host names the server may be reached by besides its address (on "
                                           "127.0.0.1 any other Host header is refused)")
    # how much at once
    max_batch: int = setting(16, "requests decoded together (rows of the KV cache)")
    max_queue: int = setting(64, "requests waiting for a row; beyond it a request gets 429 at once")
    prefix_cache: int | None = setting(
        None, "MiB of keys and values kept from prompts and finished replies, so that a prompt starting with "
              "them (a conversation's history, a shared system message) computes only the rest; least recently "
              "used out first; 0 = off; auto: a quarter of the memory free at start, at most 4096")
    # how to run
    compile: bool | None = setting(
        None, "compile the decode step, a static graph per bucket of rows and slots: True, False or auto (None: on "
              "a GPU where torch.compile can run; compiled at start, before serving)")
    access_log: bool = setting(False, "log every request on stderr")

    def validate(self) -> None:
        super().validate()  # what to load
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535 (0 = any free port), got {self.port}")
        if self.max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.prefix_cache is not None and self.prefix_cache < 0:
            raise ConfigError(f"prefix_cache must be >= 0 MiB (0 = off, auto = a quarter of the free memory), got "
                              f"{self.prefix_cache}")
        if not self.host:
            raise ConfigError("host must not be empty (127.0.0.1: this machine only)")
        for origin in self.origins():
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ConfigError(f"allowed_origins: {origin!r} is not an origin; write it as a browser "
                                  f"sends it, e.g. http://localhost:3000")
        if any("/" in h for h in self.hosts()):
            raise ConfigError("allowed_hosts takes host names (example.test or example.test:8000), not URLs")

    def origins(self) -> list[str]:
        return [o for o in self.allowed_origins if o]

    def hosts(self) -> list[str]:
        return [h for h in self.allowed_hosts if h]

    def key(self) -> str:
        """--api_key, else the GPTKIT_API_KEY environment variable (a key kept out of the process list)."""
        return self.api_key or os.environ.get("GPTKIT_API_KEY", "")

    def served_name(self) -> str:
        """--model_name, or the name of what is loaded: out-chat/best.pt -> 'out-chat', gpt2 -> 'gpt2'."""
        if self.model_name:
            return self.model_name
        if self.init_from:
            return Path(self.init_from).name if Path(self.init_from).exists() else self.init_from
        path = Path(self.ckpt or "out").resolve()
        return (path.parent if path.suffix == ".pt" else path).name


def check_packages() -> None:
    missing = [name for name in ("starlette", "uvicorn", "pydantic") if importlib.util.find_spec(name) is None]
    if missing:
        raise ServeError(f"serving needs {' and '.join(missing)}, not installed here: "
                         f"pip install -e \".[serve]\"")


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a taken port fails in a second, not after.

    Made with its protocol named (IPPROTO_TCP), unlike socket.create_server's: the connections it accepts
    inherit it, and asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets that say they are TCP.
    With Nagle on, each small write that follows an unacknowledged one (a stream's first token after the
    headers, then token after token) waited for the client's delayed acknowledgement: ~40 ms on Linux, added
    to the time to first token of every request on a kept-alive connection (measured: 44 ms against 4)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ServeError(f"--host {host!r} is not an address of this machine ({e.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        if os.name != "nt":  # a restart need not wait for the old connections to time out (as create_server)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and hasattr(socket, "IPV6_V6ONLY"):  # [::1] is IPv6 only (as create_server)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen()
        return sock
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {cli.describe_os_error(e)} (another server there? "
                         f"choose another --port)") from None


def serve(app, sock: socket.socket, cfg: ServeConfig, on_stop) -> None:
    """Run uvicorn on `sock` until SIGTERM or Ctrl-C, then let it finish the replies in flight. `on_stop` is
    called once, at the first signal."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's own re-raises the signal once it has shut down, so the process would die of SIGTERM
            # after a clean shutdown; here a signal ends the server and the process exits 0.
            loop = asyncio.get_running_loop()  # entered from uvicorn's serve() coroutine

            def handle(sig, frame):
                if not self.should_exit:  # on the loop: a print in a signal handler can interrupt a print
                    loop.call_soon_threadsafe(on_stop, signal.Signals(sig).name)
                self.handle_exit(sig, frame)  # uvicorn's: a second Ctrl-C forces the exit

            previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(app, lifespan="off", log_level="info" if cfg.access_log else "warning",
                            access_log=cfg.access_log, timeout_graceful_shutdown=None)
    Server(config).run(sockets=[sock])


@cli.entry_point(oom_hint="try a smaller --max_batch or --dtype=bfloat16")
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_config(ServeConfig, argv, allow_files=False, prog="serve.py")
    check_packages()
    sock = listen(cfg.host, cfg.port)
    with contextlib.closing(sock):
        run(cfg, sock)


def run(cfg: ServeConfig, sock: socket.socket) -> None:
    """Load the model, serve it on `sock` until a signal, finish the replies in flight."""
    from gptkit.serving.access import Policy, is_loopback
    from gptkit.serving.prefix_cache import check_bound
    from gptkit.serving.routes import create_app  # here, after check_packages: it needs Starlette

    # Decoding on the CPU, the engine's thread is to be the only one with several of torch's threads (Engine
    # says why): the model is loaded with one, and the engine sets the count chosen on its own thread.
    inference = setup_inference(cfg.device, cfg.dtype, cfg.quantize, cfg.threads, set_threads=False)
    if inference.n_threads is not None:
        torch.set_num_threads(1)
    model, tokenizer, what = checkpoint.load_model(cfg.ckpt, cfg.init_from)
    params = model.num_params(non_embedding=False)  # all of them, as train.py and --plan count (before place():
    # packed weights are buffers, not parameters)
    inference.place(model)  # the weights themselves, as sample.py: decoding reads them
    if cfg.prefix_cache:  # (after the weights took their memory: what is left is what the cache may take)
        check_bound(cfg.prefix_cache, inference.rt.device)
    engine = Engine(model, max_batch=cfg.max_batch, max_queue=cfg.max_queue, compile=cfg.compile,
                    threads=inference.n_threads,
                    prefix_cache=None if cfg.prefix_cache is None else cfg.prefix_cache * 2**20)
    host, port = sock.getsockname()[:2]
    policy = Policy.of(host, port, cfg.hosts(), cfg.origins(), cfg.key())
    app = create_app(engine, tokenizer, cfg.served_name(), policy)
    chat = "chat model" if _is_chat(tokenizer) else "text model (no chat tokens: /v1/completions only)"
    shown, elsewhere = addresses(host)
    if engine.compiled:  # tens of seconds on a GPU: say so before the wait
        print(f"serve.py: compiling the decode step for {cfg.max_batch} rows...", file=sys.stderr,
              flush=True)
    try:
        engine.start()
    except Exception as e:  # (only with --compile=True: under auto a step that cannot compile runs eagerly)
        raise ServeError(f"could not compile the decode step: {type(e).__name__}: {cli.one_line(e)}; "
                         f"serve without it: --compile=False") from None
    print(f"serve.py: {what}, {params / 1e6:.2f}M parameters, {tokenizer.kind} tokenizer, "
          f"{chat}; {inference.describe()}; max_batch {cfg.max_batch}, max_queue {cfg.max_queue}; "
          f"{engine.decode_mode}", file=sys.stderr)
    print(f"serve.py: {describe_prefix_cache(engine, cfg.prefix_cache)}", file=sys.stderr)
    if elsewhere:
        print(f"serve.py: listening on all interfaces ({cfg.host}): from other machines, http://{elsewhere}:{port}/",
              file=sys.stderr)
    if not is_loopback(host) and not policy.api_key:
        print(f"serve.py: listening on {host}: reachable from other machines, with no API key (set --api_key)",
              file=sys.stderr)
    if policy.api_key:
        print("serve.py: every /v1 request needs the API key ('Authorization: Bearer KEY'); the chat page asks "
              "for it", file=sys.stderr)
    if _is_chat(tokenizer):
        print(f"serve.py: to chat in a browser, open http://{shown}:{port}/", file=sys.stderr)
    print(f"serve.py: serving {cfg.served_name()!r} at http://{shown}:{port}/v1 (SIGTERM or Ctrl-C stops it)",
          file=sys.stderr, flush=True)

    def on_stop(name: str) -> None:
        active, waiting = engine.load
        engine.stop(timeout=0)  # new requests get 503; the accepted ones are decoded to their end
        print(f"serve.py: {name}: no new requests; finishing the {active + waiting} in flight",
              file=sys.stderr, flush=True)

    try:
        serve(app, sock, cfg, on_stop)
    finally:
        engine.stop()
    print("serve.py: stopped", file=sys.stderr)


def addresses(host: str) -> tuple[str, str]:
    """(the host of the URLs to print, for this machine's browser and clients; the machine's name for other
    machines' when the server listens on all interfaces, else ''). 0.0.0.0 and :: are where to listen, not
    addresses a browser can open: on them the URLs say 127.0.0.1 (::1)."""
    if is_unspecified(host):
        local = "127.0.0.1" if ":" not in host else "[::1]"
        return local, socket.gethostname()
    return (f"[{host}]" if ":" in host else host), ""


def describe_prefix_cache(engine: Engine, setting: int | None) -> str:
    """The start-up line's words on the prefix cache: its bound, in MiB and in this model's tokens."""
    cache = engine.prefix
    if cache is None:
        return "prefix cache off (--prefix_cache=0): every prompt is computed whole"
    how = "--prefix_cache" if setting is not None else "auto: a quarter of the free memory; --prefix_cache=MiB"
    return (f"prefix cache up to {cache.bound / 2**20:,.0f} MiB ({how}), {cache.bound // cache.token_bytes:,} "
            f"tokens of this model's keys and values; /metrics shows its use")


def _is_chat(tokenizer) -> bool:
    try:
        ChatTokens.of(tokenizer)
        return True
    except ChatError:
        return False


if __name__ == "__main__":
    main()
