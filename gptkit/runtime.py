"""Where and how a script runs: device, precision, compile, the processes of a torchrun job, stop signals.

    rt = setup_runtime(device="auto", dtype="auto")
    with rt.autocast():
        _, loss = model(x, y)      # with targets the model returns no logits

    with distributed(device, dtype, backend) as (d, rt):   # torchrun or not; an orderly teardown either way
        ...
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import importlib.metadata
import importlib.util
import os
import platform
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from gptkit.cli import UserError


class DeviceError(UserError):
    """A device or dtype this machine cannot give."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Runtime:
    device: torch.device
    dtype: torch.dtype  # compute precision of autocast; float32 means no autocast

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def dtype_name(self) -> str:
        return next(k for k, v in DTYPES.items() if v == self.dtype)

    @property
    def needs_grad_scaler(self) -> bool:
        # fp16 gradients underflow without loss scaling; bf16 has fp32's exponent range and needs none.
        return self.dtype == torch.float16 and self.device_type == "cuda"

    def autocast(self, cache: bool = True):
        """cache=False for a CUDA graph's capture: autocast's cache of cast weights is freed when its region
        ends, and the graph would go on reading the freed memory."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, cache_enabled=cache)

    def synchronize(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device_type == "mps":
            torch.mps.synchronize()


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"device {name!r} is not a device; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {name!r} asked for, but CUDA is not available here; use --device=cpu or auto")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise DeviceError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"device {name!r} asked for, but MPS is not available here; use --device=cpu or auto")
    return device


def native_bf16() -> bool:
    """Whether this GPU computes in bf16 natively (Ampere and newer). torch.cuda.is_bf16_supported() also says
    True for older GPUs (T4, V100), which emulate it: slow matmuls without tensor cores, and inductor refuses
    to compile bf16 there, so those GPUs are better served by fp16 with loss scaling."""
    return torch.cuda.is_bf16_supported(including_emulation=False)  # of the current device (set_device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if native_bf16() else torch.float16
        return torch.float32  # CPU autocast is slow for training, and MPS' is still patchy: fp32 is the safe default
    if name not in DTYPES:
        raise DeviceError(f"dtype {name!r} unknown; use auto, {', '.join(DTYPES)}")
    if name == "bfloat16" and device.type == "cuda" and not native_bf16():
        raise DeviceError("dtype bfloat16 is only emulated on this GPU (it needs Ampere or newer); use "
                          "--dtype=float16 (with loss scaling) or auto")
    return DTYPES[name]


def resolve_compile(flag: bool | None, device: torch.device) -> tuple[bool, str]:
    """Decide whether to torch.compile, and say why in one line. flag None means auto."""
    if device.type != "cuda":
        reason = f"compile off: torch.compile is not used on {device.type} by default"
        if flag:
            return True, f"compile on (asked for) on {device.type}"
        return False, reason
    if platform.system() == "Windows":
        return (False, "compile off: torch.compile needs Triton, which is not available on Windows")
    if importlib.util.find_spec("triton") is None:
        return False, "compile off: Triton is not installed, so torch.compile cannot generate GPU kernels"
    if flag is False:
        return False, "compile off (asked for)"
    return True, "compile on: torch.compile (the first steps are slow while it compiles)"


def resolve_cuda_graphs(flag: bool | None, rt: Runtime, *, world_size: int, optimizer: str,
                        compiled: bool) -> tuple[bool, str]:
    """Decide whether train.py replays its whole step as one CUDA graph (gptkit/cudagraph.py), and say why in
    one line. flag None means auto, which stays off until a GPU measurement shows the gain for the run's shape."""
    if flag is False:
        return False, "CUDA graphs off (asked for)"
    needs = []
    if rt.device_type not in GRAPH_DEVICE_TYPES:
        needs.append("a CUDA device")
    if world_size > 1:
        needs.append("one process (DDP and FSDP communicate inside the step)")
    if rt.needs_grad_scaler:
        needs.append("bfloat16 or float32 (float16's loss scaler reads its flags on the host)")
    if optimizer != "adamw":
        needs.append("--optimizer=adamw")
    if flag is None:
        return False, ("CUDA graphs off (auto; --cuda_graphs=True replays the whole step as one graph" +
                       (f", which needs {', '.join(needs)})" if needs else ")"))
    if needs:
        raise DeviceError(f"--cuda_graphs=True needs {', '.join(needs)}; drop --cuda_graphs")
    how = "compiled, " if compiled else ""
    return True, f"CUDA graphs on: the whole training step runs {how}as one graph, captured after warm-up steps"


# Where a step can be captured. (Tests add "cpu": there gptkit/cudagraph.py runs the same step eagerly.)
GRAPH_DEVICE_TYPES = ("cuda",)


def process_elapsed() -> float:
    """Seconds since this process started (on Linux from /proc, so imports and CUDA's start count too; elsewhere
    since the first call): the clock a run's elapsed_s is read on, so that it is the wall's."""
    global _FIRST_CALL
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime, in ticks
    except (OSError, ValueError, IndexError, AttributeError):
        if _FIRST_CALL is None:
            _FIRST_CALL = time.perf_counter()
        return time.perf_counter() - _FIRST_CALL


_FIRST_CALL: float | None = None


def setup_runtime(device: str = "auto", dtype: str = "auto") -> Runtime:
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev.index or 0)
        # TF32 matmuls for whatever still runs in fp32 (e.g. the optimizer's and the loss' parts): ~free speed.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        dev = torch.device("cuda", dev.index or 0)
    return Runtime(device=dev, dtype=resolve_dtype(dtype, dev))


# ----------------------------------------------------------------------------- decoding: sample, chat, serve

# The decoding scripts' --quantize: "none" runs the model as loaded; float32, float16 and int8 are
# gptkit/cpu_decode.py's weight formats for the Linear layers (CPU only); "auto" (the default) is float32 on
# the CPU when the weights are float32 (the same weights and logits, read by faster kernels) and none elsewhere.
# (The setting itself, with its help, is gptkit/config.py's DecodeSettings.quantize.)
QUANTIZE = ("auto", "none", "float32", "float16", "int8")


@dataclass
class Inference:
    """How a decoding script runs its model: the runtime, the weights' format (QUANTIZE) and, on the CPU, a
    few words on the thread count chosen (setup_inference)."""

    rt: Runtime
    quantize: str = "none"  # resolved: never "auto"
    threads: str = ""
    kernels: str = ""  # set by place: which code computes the packed products
    auto: bool = False  # quantize was chosen by --quantize=auto: place() keeps the model as loaded where the
    # kernels cannot run (torch's products from packed weights would be no faster)
    n_threads: int | None = None  # torch's CPU threads chosen (None: torch's own count, left as it is)

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move the model to the runtime's device and dtype (the weights themselves, not autocast: decoding
        one token reads every weight, so their size is its speed) and, with --quantize, swap its Linear
        layers for gptkit/cpu_decode.py's packed ones. Compiles the kernels now (~30 s the first time), not
        at the first token. Count the model's parameters before: packed weights are no parameters."""
        model.to(device=self.rt.device, dtype=self.rt.dtype)
        if self.quantize != "none":
            from gptkit import cpu_decode

            if cpu_decode.kernels() is None and self.auto:
                self.quantize = "none"
                return model
            cpu_decode.pack_for_cpu(model, self.quantize)
            self.kernels = cpu_decode.kernels_status()
        return model

    def describe(self) -> str:
        """For the script's status line, e.g. 'cpu float32, int8 weights (AVX2 kernels), 2 threads (...)'."""
        parts = [f"{self.rt.device} {self.rt.dtype_name}"]
        if self.quantize != "none":
            parts.append(f"{self.quantize} weights" + (f" ({self.kernels})" if self.kernels else ""))
        if self.threads:
            parts.append(self.threads)
        return ", ".join(parts)


def setup_inference(device: str = "auto", dtype: str = "auto", quantize: str = "auto",
                    threads: int = 0, *, set_threads: bool = True) -> Inference:
    """setup_runtime for the scripts that decode (sample.py, chat.py, serve.py), before the model is loaded:
    resolves --quantize=auto (float32 on the CPU in float32, else none), refuses a --quantize this runtime
    cannot use (a one-line DeviceError) and chooses the CPU's thread count, --threads, or OMP_NUM_THREADS when
    set (torch reads it at start), else cpu_decode.choose_threads(): Inference.n_threads. set_threads: set it
    on this thread now (torch.set_num_threads); serve.py sets it on its engine's thread instead (Engine says
    why: setting it here would already start this thread's OpenMP workers)."""
    rt = setup_runtime(device, dtype)
    if quantize not in QUANTIZE:
        raise DeviceError(f"quantize {quantize!r} unknown; use {', '.join(QUANTIZE)}")
    auto = quantize == "auto"
    if auto:
        quantize = "float32" if rt.device_type == "cpu" and rt.dtype == torch.float32 else "none"
    if quantize != "none" and rt.device_type != "cpu":
        raise DeviceError(f"--quantize={quantize} is for decoding on the CPU; on {rt.device_type} choose the "
                          f"weights' precision with --dtype (e.g. bfloat16), or use --device=cpu")
    if quantize != "none" and rt.dtype != torch.float32:
        raise DeviceError(f"--quantize={quantize} computes in float32 from {quantize} weights; it does not "
                          f"combine with --dtype={rt.dtype_name} (leave --dtype at auto)")
    if threads < 0:
        raise DeviceError(f"threads must be >= 0 (0 = auto), got {threads}")
    if rt.device_type == "cpu":
        keep_freed_memory()
    note, n = "", None
    if threads:
        n, note = threads, f"{_threads(threads)} (--threads)"
    elif rt.device_type == "cpu" and os.environ.get("OMP_NUM_THREADS"):
        n = torch.get_num_threads()
        note = f"{_threads(n)} (OMP_NUM_THREADS)"
    elif rt.device_type == "cpu":
        from gptkit.cpu_decode import choose_threads

        n, why = choose_threads()
        note = f"{_threads(n)} ({why}; --threads to choose)"
    if n is not None and set_threads:
        torch.set_num_threads(n)
    return Inference(rt, quantize, note, auto=auto, n_threads=n)


def keep_freed_memory() -> bool:
    """On glibc (Linux), keep the memory of freed blocks of up to 32 MiB in the process for the next ones,
    instead of giving it back to the system and taking it again: a decode step's tensors of a few MB (16 rows
    of 50K logits: 3.2 MB) were otherwise mapped afresh every step, and each new page cost a fault (the
    serving engine's draw for 16 rows: 3.4 ms against 0.57 ms kept; 2 cores). glibc maps blocks above its
    threshold (128 KiB, raised as they are freed) and trims the heap's free top; both limits are set here.
    Returns whether they were set (False elsewhere: other allocators, other systems)."""
    if platform.system() != "Linux":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h>
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 256 << 20))


_HUGE_RANGES: dict[int, tuple[int, int]] = {}  # start -> (start, end) of each live mapping huge_page_copy made


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of the CPU tensor `t` (contiguous, 2 MiB or more) in a mapping of its own that starts on a
    2 MiB boundary and that Linux is asked to back with 2 MiB pages (madvise(MADV_HUGEPAGE): transparent huge
    pages in their usual "madvise" mode). Decoding reads every weight once per token, hundreds of MB in page
    order: with 4 KiB pages each one costs a TLB miss (GPT-2 small, batch 1, 2 threads, in one process on a
    VM: float32 1.02-1.34x faster over runs, int8 1.07x; BENCHMARKS.md). The mapping ends where the data does (its
    last part, less than 2 MiB, stays in 4 KiB pages: no page is larger than what it holds) and is unmapped
    when the tensor, and every view of it, is gone. Where this is not Linux, `t` is smaller, or the kernel
    refuses: `t` itself."""
    import mmap
    import weakref

    huge, small = 2 << 20, mmap.PAGESIZE
    nbytes = t.numel() * t.element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or t.device.type != "cpu" or not t.is_contiguous() or nbytes < huge:
        return t
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                               ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    reserved = nbytes + huge
    start = libc.mmap(None, reserved, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                      -1, 0)
    if start is None or start == ctypes.c_void_p(-1).value:
        return t
    begin, length = start + (-start % huge), nbytes + (-nbytes % small)  # aligned; whole small pages
    for lo, hi in ((start, begin), (begin + length, start + reserved)):  # keep [begin, begin + length) only
        if hi > lo:
            libc.munmap(lo, hi - lo)
    if libc.madvise(begin, length, advice) != 0:
        libc.munmap(begin, length)
        return t
    buf = (ctypes.c_char * length).from_address(begin)
    weakref.finalize(buf, _unmap, libc, begin, length)
    _HUGE_RANGES[begin] = (begin, begin + length)
    copy = torch.frombuffer(buf, dtype=torch.uint8)[:nbytes].view(t.dtype).view(t.shape)  # (holds buf)
    copy.copy_(t)  # the first touch: the pages come in 2 MiB where the kernel has them
    return copy


def _unmap(libc: ctypes.CDLL, begin: int, length: int) -> None:
    _HUGE_RANGES.pop(begin, None)
    libc.munmap(begin, length)


def in_huge_pages(t: torch.Tensor) -> bool:
    """Whether `t`'s data lies in a mapping that huge_page_copy made (a view of its copy included)."""
    at = t.data_ptr()
    return any(lo <= at < hi for lo, hi in _HUGE_RANGES.values())


def _threads(n: int) -> str:
    """'1 thread', '2 threads'."""
    return f"{n} thread{'s' * (n != 1)}"


# ----------------------------------------------------------------------------- torchrun jobs


@dataclass
class Dist:
    """Where this process sits in a torchrun job (world_size 1 without torchrun)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def master(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def process_device(device: str, local_rank: int, cuda_available: bool) -> str:
    """The device of one torchrun process: the GPU of its LOCAL_RANK. An explicit cuda:N would put every
    process on the same GPU, so it is refused; CUDA_VISIBLE_DEVICES is how to pick the GPUs a job uses."""
    if device.startswith("cuda:"):
        raise DeviceError(f"--device={device} under torchrun would put every process on that one GPU; use "
                          f"--device=cuda (or auto): each process takes the GPU of its LOCAL_RANK. To choose "
                          f"the GPUs, set CUDA_VISIBLE_DEVICES")
    if device in ("auto", "cuda") and cuda_available:
        return f"cuda:{local_rank}"  # one GPU per process
    return "cpu" if device == "auto" else device


@contextlib.contextmanager
def distributed(device: str = "auto", dtype: str = "auto", backend: str = "auto") -> Iterator[tuple[Dist, Runtime]]:
    """This process' place in the job and its runtime; under torchrun (RANK set) one GPU per process and a
    process group, which is taken down in order on the way out.

    A finished run waits for every rank at a barrier before destroying the process group: a rank that
    destroys it while another is still in its last collective makes gloo abort that process at exit. A
    failed run skips the barrier (the other ranks may never reach it) and just leaves.
    """
    if "RANK" not in os.environ:
        yield Dist(), setup_runtime(device, dtype)
        return
    d = Dist(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    rt = setup_runtime(process_device(device, d.local_rank, torch.cuda.is_available()), dtype)
    if backend == "auto":
        backend = "nccl" if rt.device_type == "cuda" else "gloo"
    # device_id binds the group to this GPU at once (NCCL then sets up eagerly and never guesses the device).
    dist.init_process_group(backend=backend, device_id=rt.device if rt.device_type == "cuda" else None,
                            **attempt_store(d))
    finished = False
    try:
        yield d, rt
        finished = True
    finally:
        if finished:
            # What the run left in reference cycles (an FSDP model: its modules and hooks refer to each other)
            # still holds the group's communication objects; freed at interpreter exit instead, gloo's can
            # abort the process (SIGABRT after a finished run). Free them now, while everything is alive.
            gc.collect()
            dist.barrier()
            leave_in_order(d)
        else:
            dist.destroy_process_group()


def attempt_store(d: Dist) -> dict:
    """init_process_group's store and ranks for an attempt restarted by torchrun (--max-restarts), else nothing
    (env://, as torchrun's variables say). torchrun keeps one key-value store for every attempt of a job, and
    the process group's keys (where each process listens) are not renamed per attempt: a restarted process could
    read the address of a process that died with the last attempt, and its connection is refused. Here every
    attempt has keys of its own: the same store (torchrun's agent holds it, or else rank 0), under a prefix."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0":
        return {}
    agent_holds_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), d.world_size,
                          is_master=d.master and not agent_holds_it, multi_tenant=not agent_holds_it)
    return {"store": dist.PrefixStore(f"gptkit_attempt_{attempt}", store), "rank": d.rank,
            "world_size": d.world_size}


def leave_in_order(d: Dist) -> None:
    """Take the process group down with rank 0 last. After the final barrier rank 0 can be done while another
    rank is still finishing its part of it; a rank 0 that tears its connections down then made gloo abort
    that rank now and then (SIGABRT at the very end of a finished CPU run). The others take theirs down
    first and say so through the job's key-value store, which rank 0 waits on (a minute at most)."""
    store = dist.distributed_c10d._get_default_store()
    if not d.master:
        dist.destroy_process_group()
        store.set(f"gptkit_left_{d.rank}", "1")
        return
    try:
        store.wait([f"gptkit_left_{r}" for r in range(1, d.world_size)], datetime.timedelta(seconds=60))
    except Exception:  # a rank that died on its way out: leave anyway
        pass
    dist.destroy_process_group()


class StopFlag:
    """SIGTERM / Ctrl-C set a flag instead of killing the process: a training loop finishes its step (or cuts
    an evaluation short), saves and exits with `exit_code`. A second Ctrl-C interrupts at once. SIGUSR1 asks for
    a save and no stop: `save_requested`, until a StepRequests sends it (Unix only)."""

    def __init__(self):
        self.requested = False
        self.save_requested = False
        self.signum: int | None = None  # the signal that asked to stop, once one has
        self.previous = {}

    @property
    def exit_code(self) -> int:
        """128 + the signal's number (143 for SIGTERM, 130 for Ctrl-C), as a shell reports a process killed
        by it: a scheduler sees a run that was stopped, not one that finished, and can requeue it."""
        return 128 + (self.signum or signal.SIGTERM)

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handle)
        if hasattr(signal, "SIGUSR1"):
            self.previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._handle_save)
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum
        print(f"\n{signal.Signals(signum).name} received: finishing this step (or cutting the evaluation short), "
              f"then saving last.pt (once a step has finished)", flush=True)

    def _handle_save(self, signum, frame):
        self.save_requested = True
        print("\nSIGUSR1 received: saving last.pt after this step, then going on", flush=True)

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


# What a process asks of the next step boundary, sent with the step's flags (gptkit's train.py: step_flags): the
# largest request over the processes wins, so every process saves, or stops, after the same step.
GO_ON, SAVE, STOP = 0.0, 0.5, 1.0


class StepRequests:
    """This process' request for the next step boundary: STOP after a stop signal; SAVE (last.pt, then go on)
    after a SIGUSR1 here or, on the process that owns the clock (rank 0: one clock decides for the job), once
    `interval_s` seconds have passed since the last save; else GO_ON. A request is sent once: `next()` forgets
    a SIGUSR1 and restarts the clock as it returns SAVE. `clock`: seconds, monotonic (tests pass their own)."""

    def __init__(self, stop: StopFlag, interval_s: float = 0.0, owns_clock: bool = True, clock=time.monotonic):
        self.stop, self.interval_s, self.owns_clock, self.clock = stop, interval_s, owns_clock, clock
        self.since = clock() if owns_clock and interval_s else 0.0

    def next(self) -> float:
        if self.stop.requested:
            return STOP
        due = self.owns_clock and self.interval_s > 0 and self.clock() - self.since >= self.interval_s
        if self.stop.save_requested or due:
            self.stop.save_requested = False
            self.saved()
            return SAVE
        return GO_ON

    def saved(self) -> None:
        """last.pt was just saved (or a save is on its way): the clock starts again."""
        if self.owns_clock and self.interval_s:
            self.since = self.clock()


def library_versions() -> dict[str, str]:
    """The versions that make a run reproducible, for the run record and the checkpoints."""
    import numpy

    # str(): torch.__version__ is a TorchVersion object, which a weights_only load would refuse to unpickle
    versions = {"python": platform.python_version(), "torch": str(torch.__version__), "numpy": numpy.__version__}
    for name in ("tiktoken", "datasets", "safetensors"):
        try:  # the installed version, without importing it (datasets alone takes seconds to import)
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        versions["cuda"] = str(torch.version.cuda)
    return versions


def code_version(checkout: Path) -> dict:
    """Which code made a run: the installed gptkit's version and, when `checkout` (the folder of the script
    that runs) is a git work tree, its commit and whether tracked files had uncommitted changes."""
    try:
        version = importlib.metadata.version("gptkit")
    except importlib.metadata.PackageNotFoundError:
        version = None

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):  # no git on this machine, or a hung file system
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"gptkit": version, "commit": commit, "dirty": None if status is None else bool(status)}
