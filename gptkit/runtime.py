"""Where and how a script runs: device, precision, compile and CUDA graphs (each decision with a line saying
why), the processes of a torchrun job, and what a run records of its code and libraries.

    rt = setup_runtime(device="auto", dtype="auto")
    with rt.autocast():
        _, loss = model(x, y)      # with targets the model returns no logits

    with distributed(device, dtype, backend) as (d, rt):   # torchrun or not; an orderly teardown either way
        ...

Placing a model for decoding (--quantize, threads) is gptkit/inference.py's; stop signals and the requests a
process sends to the next step boundary are gptkit/step.py's, beside the step.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from gptkit.cli import UsageError, UserError


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
                        compiled: bool, ungraphable: str | None = None) -> tuple[bool, str]:
    """Decide whether train.py replays its whole step as one CUDA graph (gptkit/cudagraph.py), and say why in
    one line. flag None means auto, which stays off until a GPU measurement shows the gain for the run's shape.
    ungraphable: the run's objective's name when its step cannot be captured (its graphable: False)."""
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
    if ungraphable:
        needs.append(f"an objective whose step can be captured (objective={ungraphable} draws new data in its step)")
    if flag is None:
        return False, ("CUDA graphs off (auto; --cuda_graphs=True replays the whole step as one graph" +
                       (f", which needs {', '.join(needs)})" if needs else ")"))
    if needs:
        raise DeviceError(f"--cuda_graphs=True needs {', '.join(needs)}; drop --cuda_graphs")
    how = "compiled, " if compiled else ""
    return True, f"CUDA graphs on: the whole training step runs {how}as one graph, captured after warm-up steps"


# torch.compile's modes that record CUDA graphs of their own: not inside a capture of the whole step.
GRAPHING_COMPILE_MODES = ("reduce-overhead", "max-autotune")


def refuse_uncapturable(cuda_graphs: bool | None, *, activation_checkpointing: bool = False,
                        compile_modes: tuple[str, ...] | list[str] = ()) -> None:
    """A one-line UsageError, before the first step, for settings the whole-step capture cannot record:
    activation checkpointing (recomputing a block saves and restores the CUDA random state, which a capture
    refuses) and torch.compile's modes that record CUDA graphs of their own (no graph inside a capture)."""
    if not cuda_graphs:
        return
    if activation_checkpointing:
        raise UsageError("--activation_checkpointing=True cannot run with --cuda_graphs=True (recomputing a block "
                         "reads the CUDA random state, which a graph capture refuses); drop one of the two")
    graphing = [mode for mode in compile_modes if mode in GRAPHING_COMPILE_MODES]
    if graphing:
        raise UsageError(f"--compile_mode={graphing[0]} records CUDA graphs of its own, which cannot sit inside "
                         f"--cuda_graphs=True's capture of the whole step; use --compile_mode=default or "
                         f"max-autotune-no-cudagraphs with --cuda_graphs=True, or --cuda_graphs=False")


# Where a step can be captured. (Tests add "cpu": there gptkit/cudagraph.py runs the same step eagerly.)
GRAPH_DEVICE_TYPES = ("cuda",)


def ram() -> tuple[int, int]:
    """(total, available) bytes of this machine's memory (Linux's MemTotal and MemAvailable; elsewhere the
    total for both)."""
    try:
        info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        return int(info["MemTotal"].split()[0]) * 1024, int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total


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
