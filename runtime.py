"""Device, precision and compile setup: the one place every script asks "where and how do I run?".

    rt = setup_runtime(device="auto", dtype="auto")
    with rt.autocast():
        logits, loss = model(x, y)
"""

from __future__ import annotations

import contextlib
import importlib.util
import platform
from dataclasses import dataclass

import torch

from cli import UserError


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

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

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


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32  # CPU autocast is slow for training, and MPS' is still patchy: fp32 is the safe default
    if name not in DTYPES:
        raise DeviceError(f"dtype {name!r} unknown; use auto, {', '.join(DTYPES)}")
    if name == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError("dtype bfloat16 is not supported on this GPU; use --dtype=float16 (with loss scaling)")
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


def setup_runtime(device: str = "auto", dtype: str = "auto") -> Runtime:
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev.index or 0)
        # TF32 matmuls for whatever still runs in fp32 (e.g. the optimizer's and the loss' parts): ~free speed.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        dev = torch.device("cuda", dev.index or 0)
    return Runtime(device=dev, dtype=resolve_dtype(dtype, dev))
