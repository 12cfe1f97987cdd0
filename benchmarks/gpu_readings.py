"""What the GPU says about itself, read through NVML: its clocks (SM and memory, now and their maximum), power
draw and limit, temperature, why its clocks are held down (the throttle reasons, by name) and the other
processes on it. gpu_check reads them at its start and while it times the matmul peak, so that a low figure can
be told apart: a power cap, throttled clocks, heat or a neighbour on the same GPU.

Through the `nvidia-ml-py` bindings (`import pynvml`) where installed, else `nvidia-smi --query-gpu=...
--format=csv` (and `--query-compute-apps` for the processes), else none: the reading then says what is missing
in one line, and gpu_check goes on. A module of the benchmarks, not a script; Python's standard library only,
as gpu_check's own imports are.
"""

from __future__ import annotations

import importlib
import os
import shutil
import statistics
import subprocess
import threading
from collections.abc import Callable

# NVML's clock event (throttle) reasons: the bits of nvmlDeviceGetCurrentClocksEventReasons and of nvidia-smi's
# clocks_event_reasons.active (clocks_throttle_reasons.active before driver 535), by name. gpu_idle is no
# throttle: an idle GPU lowers its clocks.
THROTTLE_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
                    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}

# nvidia-smi --query-gpu's fields, in the order read; the throttle reasons' field has had two names (tried in
# turn: a driver that knows neither is read without it).
SMI_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem", "power.draw",
              "power.limit", "temperature.gpu")
SMI_REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active", None)
SMI_KEYS = ("name", "driver", "sm_clock_mhz", "sm_clock_max_mhz", "mem_clock_mhz", "mem_clock_max_mhz", "power_w",
            "power_limit_w", "temperature_c")
SMI_TIMEOUT_S = 10
MISSING = ("no GPU readings: neither the nvidia-ml-py bindings (import pynvml) nor nvidia-smi is here "
           "(pip install nvidia-ml-py, or the NVIDIA driver's tools on PATH)")


def reasons(mask: int | None) -> list[str] | None:
    """The names of the bits set in an NVML throttle-reason mask (an unknown bit by its hex value)."""
    if mask is None:
        return None
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    unknown = mask & ~sum(THROTTLE_REASONS)
    return names + ([hex(unknown)] if unknown else [])


def read(index: int = 0, processes: bool = True) -> dict:
    """One reading of GPU `index` (NVML's numbering: the driver's, not CUDA_VISIBLE_DEVICES'): through pynvml,
    else nvidia-smi, else none. Always a dict with "source" (pynvml, nvidia-smi or None) and "error" (None, or
    what went wrong in one line, or what is missing); `processes`: also the other processes on the GPU (this
    one left out)."""
    errors = []
    try:
        pynvml = importlib.import_module("pynvml")
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            return {"source": "pynvml", "error": None, **read_nvml(pynvml, index, processes)}
        except Exception as e:  # (an NVMLError: no driver, a GPU lost) tried through nvidia-smi instead
            errors.append(f"pynvml: {type(e).__name__}: {e}")
    if shutil.which("nvidia-smi"):
        try:
            return {"source": "nvidia-smi", "error": "; ".join(errors) or None, **read_smi(index, processes)}
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            errors.append(f"nvidia-smi: {' '.join(str(e).split())[:300]}")
    return {"source": None, "error": "; ".join(errors) if errors else MISSING}


def text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def read_nvml(pynvml, index: int, processes: bool) -> dict:
    """A reading through the nvidia-ml-py bindings (milliwatts and bytes made watts and MiB)."""
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)

        def optional(call: Callable, *args):  # (a field the GPU or driver does not support: None)
            try:
                return call(handle, *args)
            except pynvml.NVMLError:
                return None

        events = (getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)  # (the name before 12.535)
                  or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)
        power, limit = optional(pynvml.nvmlDeviceGetPowerUsage), optional(pynvml.nvmlDeviceGetEnforcedPowerLimit)
        mask = optional(events)
        found = {"name": text(pynvml.nvmlDeviceGetName(handle)), "driver": text(pynvml.nvmlSystemGetDriverVersion()),
                 "sm_clock_mhz": optional(pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_SM),
                 "sm_clock_max_mhz": optional(pynvml.nvmlDeviceGetMaxClockInfo, pynvml.NVML_CLOCK_SM),
                 "mem_clock_mhz": optional(pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_MEM),
                 "mem_clock_max_mhz": optional(pynvml.nvmlDeviceGetMaxClockInfo, pynvml.NVML_CLOCK_MEM),
                 "power_w": None if power is None else power / 1000,
                 "power_limit_w": None if limit is None else limit / 1000,
                 "temperature_c": optional(pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU),
                 "throttle_mask": mask, "throttle_reasons": reasons(mask)}
        if processes:
            found["processes"] = []
            for p in optional(pynvml.nvmlDeviceGetComputeRunningProcesses) or []:
                if p.pid == os.getpid():
                    continue
                try:
                    name = text(pynvml.nvmlSystemGetProcessName(p.pid))
                except pynvml.NVMLError:
                    name = None
                used = getattr(p, "usedGpuMemory", None)
                found["processes"].append({"pid": p.pid, "name": name,
                                           "used_mib": None if used is None else round(used / 2**20)})
        return found
    finally:
        pynvml.nvmlShutdown()


def smi(*args: str) -> str:
    """nvidia-smi's output; a failure (its exit code, with what it printed) raises ValueError."""
    done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
    if done.returncode != 0:
        raise ValueError(f"nvidia-smi {args[0]} exited {done.returncode}: {(done.stdout + done.stderr).strip()[:300]}")
    return done.stdout


def number(value: str) -> float | int | None:
    """A CSV value of nvidia-smi (--format=csv,noheader,nounits): an int, a float, or None for "[N/A]" and the
    like."""
    value = value.strip()
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        return None


def smi_values(index: int) -> tuple[list[str | None], str | None]:
    """The values of SMI_FIELDS as nvidia-smi prints them, and the throttle-reason mask's: in one query where
    the driver knows every field (the reasons' under either of its names), else one field at a time (a field it
    does not know: None; none known: the first error raised)."""
    error = None
    for reason in SMI_REASONS:
        fields = SMI_FIELDS + ((reason,) if reason else ())
        try:
            out = smi(f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", f"--id={index}")
        except ValueError as e:
            error = error or e
            continue
        values = [v.strip() for v in out.strip().splitlines()[0].split(",")] if out.strip() else []
        if len(values) == len(fields):
            return values[:len(SMI_FIELDS)], values[-1] if reason else None
    one = {}
    for field in SMI_FIELDS + SMI_REASONS[:-1]:
        try:
            one[field] = smi(f"--query-gpu={field}", "--format=csv,noheader,nounits", f"--id={index}").strip() or None
        except ValueError:
            one[field] = None
    if all(value is None for value in one.values()):
        raise error or ValueError("nvidia-smi --query-gpu printed nothing")
    return [one[field] for field in SMI_FIELDS], one[SMI_REASONS[0]] or one[SMI_REASONS[1]]


def read_smi(index: int, processes: bool) -> dict:
    """A reading through nvidia-smi's CSV queries: the GPU's fields, then its compute processes."""
    values, mask_text = smi_values(index)
    found = {key: value if key in ("name", "driver") else number(value or "")
             for key, value in zip(SMI_KEYS, values)}
    mask = int(mask_text, 16) if mask_text and mask_text.startswith("0x") else None
    found.update(throttle_mask=mask, throttle_reasons=reasons(mask))
    if processes:
        try:
            uuid = smi("--query-gpu=uuid", "--format=csv,noheader", f"--id={index}").strip()
            apps = smi("--query-compute-apps=gpu_uuid,pid,process_name,used_memory", "--format=csv,noheader,nounits")
        except ValueError as e:  # (the clocks read are kept)
            found.update(processes=None, processes_error=" ".join(str(e).split())[:300])
            return found
        found["processes"] = []
        for row in apps.strip().splitlines():
            parts = [p.strip() for p in row.split(",")]
            if len(parts) != 4 or parts[0] != uuid or number(parts[1]) is None or number(parts[1]) == os.getpid():
                continue  # (another GPU's, a "No running processes found" line, this process)
            found["processes"].append({"pid": number(parts[1]), "name": parts[2], "used_mib": number(parts[3])})
    return found


def line(reading: dict) -> str:
    """A reading in one line, for the summary and the log."""
    if reading.get("source") is None:
        return reading.get("error") or MISSING

    def of(value, most, unit: str) -> str:
        shown = "?" if value is None else f"{value:,.0f}"
        return f"{shown}{'' if most is None else f'/{most:,.0f}'} {unit}"

    power = f"{of(reading.get('power_w'), None, 'W')} of {of(reading.get('power_limit_w'), None, 'W')}"
    throttle = reading.get("throttle_reasons")
    others = reading.get("processes")
    words = [f"SM {of(reading.get('sm_clock_mhz'), reading.get('sm_clock_max_mhz'), 'MHz')}",
             f"memory {of(reading.get('mem_clock_mhz'), reading.get('mem_clock_max_mhz'), 'MHz')}", power,
             f"{of(reading.get('temperature_c'), None, 'C')}",
             f"throttle: {'not read' if throttle is None else ', '.join(throttle) or 'none'}"]
    if others is not None:
        words.append("other processes: " + (", ".join(f"{p['pid']} {p['name']} ({p['used_mib']} MiB)"
                                                      for p in others) or "none"))
    return f"{reading.get('name')} ({reading['source']}): " + "; ".join(words)


class Sampler:
    """Readings taken on a thread while something runs (the matmul peak): every `interval_s` until stopped.
    `summary()`: how many, the SM clock's least, median and most, the most power and heat, and every throttle
    reason seen."""

    def __init__(self, index: int = 0, interval_s: float = 0.2, reader: Callable[..., dict] = read):
        self.index, self.interval_s, self.reader = index, interval_s, reader
        self.readings: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.readings.append(self.reader(self.index, processes=False))
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=SMI_TIMEOUT_S + 1)

    def summary(self) -> dict:
        read_ok = [r for r in self.readings if r.get("source")]
        if not read_ok:
            return {"samples": 0, "error": self.readings[0].get("error") if self.readings else "no reading taken"}
        sm = [r["sm_clock_mhz"] for r in read_ok if r.get("sm_clock_mhz") is not None]
        power = [r["power_w"] for r in read_ok if r.get("power_w") is not None]
        heat = [r["temperature_c"] for r in read_ok if r.get("temperature_c") is not None]
        seen = []
        for r in read_ok:
            seen += [name for name in r.get("throttle_reasons") or [] if name not in seen]
        return {"samples": len(read_ok), "source": read_ok[0]["source"],
                "sm_clock_mhz": {"min": min(sm), "median": statistics.median(sm), "max": max(sm)} if sm else None,
                "sm_clock_max_mhz": read_ok[0].get("sm_clock_max_mhz"), "mem_clock_mhz": read_ok[-1].get("mem_clock_mhz"),
                "power_w_max": max(power, default=None), "power_limit_w": read_ok[0].get("power_limit_w"),
                "temperature_c_max": max(heat, default=None), "throttle_reasons": seen}


def sampled_line(summary: dict) -> str:
    """A Sampler's summary in one line."""
    if not summary.get("samples"):
        error = summary.get("error")
        return f"no readings ({'neither pynvml nor nvidia-smi here' if error == MISSING else error})"
    sm = summary["sm_clock_mhz"]
    clocks = "SM ?" if sm is None else f"SM {sm['min']:,.0f}-{sm['max']:,.0f} MHz (median {sm['median']:,.0f}"
    most = summary["sm_clock_max_mhz"]
    clocks += "" if sm is None else f" of max {'?' if most is None else f'{most:,.0f}'})"
    power = summary["power_w_max"]
    return (f"{clocks}, up to {'?' if power is None else f'{power:,.0f}'} W of {summary['power_limit_w'] or '?'}, "
            f"up to {summary['temperature_c_max']} C, throttle: {', '.join(summary['throttle_reasons']) or 'none'} "
            f"({summary['samples']} readings)")
