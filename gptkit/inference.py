"""Placing a model for decoding (sample.py, chat.py, serve.py): the device and dtype of its weights, the CPU
formats of its Linear layers (--quantize: gptkit/cpu_decode.py's packed kernels), the CPU's thread count, and
glibc's policy for freed memory.

    inference = setup_inference(device="auto", dtype="auto", quantize="auto", threads=0)
    model = inference.place(model)      # on its device, in its dtype; packed for the CPU kernels with --quantize
    print(inference.describe())         # e.g. "cpu float32, float32 weights (AVX2 kernels), 2 threads (auto: ...)"

Training's runtime (device, dtype, autocast, compile, torchrun) is gptkit/runtime.py's; this module builds on it.
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass

import torch

from gptkit import cpu_decode
from gptkit.runtime import DeviceError, Runtime, setup_runtime
from gptkit.settings import QUANTIZE
from gptkit.threads import resolve_threads


@dataclass
class Inference:
    """How a decoding script runs its model: the runtime, the weights' format (QUANTIZE) and, on the CPU, a
    few words on the thread count chosen (setup_inference)."""

    rt: Runtime
    quantize: str = "none"  # resolved: never "auto"
    threads: str = ""
    kernels: str = ""  # set by place: which code computes the packed products
    weights: str = ""  # set by place: the packed weights' bytes and formats (cpu_decode.weights_report)
    auto: bool = False  # quantize was chosen by --quantize=auto: place() keeps the model as loaded where the
    # kernels cannot run (torch's products from packed weights would be no faster)
    n_threads: int | None = None  # torch's CPU threads chosen (None: torch's own count, left as it is)

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move the model to the runtime's device and dtype (the weights themselves, not autocast: decoding
        one token reads every weight, so their size is its speed) and, with --quantize, swap its Linear
        layers for gptkit/cpu_decode.py's packed ones. Compiles the kernels now (~30 s the first time), not
        at the first token. Count the model's parameters before: packed weights are no parameters."""
        model.to(device=self.rt.device, dtype=self.rt.dtype)
        if self.auto and self.quantize == "float32" and getattr(model, "gguf_dtype", None) == "q4_0":
            self.quantize = "q4_0"  # a q4_0 GGUF file (gptkit/gguf_load.py): its own blocks, not 5x their bytes
        if self.quantize != "none":
            if cpu_decode.kernels() is None and self.auto:
                self.quantize = "none"
                return model
            cpu_decode.pack_for_cpu(model, self.quantize)
            self.kernels = cpu_decode.kernels_status()
            self.weights = cpu_decode.weights_report(model)
        return model

    def describe(self) -> str:
        """For the script's status line, e.g. 'cpu float32, int8 weights (AVX2 kernels), 2 threads (...);
        weights 1.2 MB: ...' (the packed weights' bytes and formats, cpu_decode.weights_report)."""
        parts = [f"{self.rt.device} {self.rt.dtype_name}"]
        if self.quantize != "none":
            parts.append(f"{self.quantize} weights" + (f" ({self.kernels})" if self.kernels else ""))
        if self.threads:
            parts.append(self.threads)
        return ", ".join(parts) + (f"; {self.weights}" if self.weights else "")


def setup_inference(device: str = "auto", dtype: str = "auto", quantize: str = "auto",
                    threads: int = 0, *, set_threads: bool = True) -> Inference:
    """setup_runtime for the scripts that decode (sample.py, chat.py, serve.py), before the model is loaded:
    resolves --quantize=auto (float32 on the CPU in float32, else none), refuses a --quantize this runtime
    cannot use (a one-line DeviceError) and chooses the CPU's thread count, --threads, or OMP_NUM_THREADS when
    set (torch reads it at start), else the cores other processes leave free (gptkit/threads.py's
    resolve_threads, as train.py and eval.py choose theirs): Inference.n_threads. set_threads: set it
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
    try:
        chosen = resolve_threads(threads, rt.device_type)
    except ValueError as e:
        raise DeviceError(str(e)) from None
    if rt.device_type == "cpu":
        keep_freed_memory()
    # (on a GPU: torch's own count, left as it is and not shown, unless --threads sets it)
    n, note = chosen.n, chosen.describe() if chosen.n is not None else ""
    if n is not None and set_threads:
        torch.set_num_threads(n)
    return Inference(rt, quantize, note, auto=auto, n_threads=n)


def keep_freed_memory() -> bool:
    """On glibc (Linux), keep the memory of freed blocks of up to 32 MiB in the process for the next ones,
    instead of giving it back to the system and taking it again: a decode step's tensors of a few MB (16 rows
    of 50K logits: 3.2 MB) were otherwise mapped afresh every step, and each new page cost a fault
    (BENCHMARKS.md, "serve.py beside llama-server, native and AVX2 builds": the draw before and after). glibc
    maps blocks above its threshold (128 KiB, raised as they are freed) and trims the heap's free top; both
    limits are set here. Returns whether they were set (False elsewhere: other allocators, other systems)."""
    if platform.system() != "Linux":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h>
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 256 << 20))
