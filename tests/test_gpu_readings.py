"""benchmarks/gpu_readings.py on the CPU, its three paths: the nvidia-ml-py bindings (a fake pynvml module
answering as NVML does: milliwatts, bytes, a throttle-reason mask), nvidia-smi's CSV queries (a fake nvidia-smi
on PATH printing what the real one prints for an H200), and neither (one line saying what is missing). Each
reading is checked against the values the fake was given, converted."""

import os
import sys
import textwrap
import types

import pytest

from benchmarks import gpu_readings

MIB = 2**20


class NVMLError(Exception):
    pass


def fake_pynvml(other_pid: int = 4242, throttle: int = 0x4 | 0x20, new_names: bool = True):
    """A pynvml module with the calls gpu_readings makes; the power draw unsupported where power is None."""
    calls = []
    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError
    m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM, m.NVML_TEMPERATURE_GPU = 1, 2, 0
    m.nvmlInit = lambda: calls.append("init")
    m.nvmlShutdown = lambda: calls.append("shutdown")
    m.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H200"  # (bytes in older bindings)
    m.nvmlSystemGetDriverVersion = lambda: "570.86.15"
    m.nvmlDeviceGetClockInfo = lambda h, kind: {1: 1755, 2: 3201}[kind]
    m.nvmlDeviceGetMaxClockInfo = lambda h, kind: {1: 1980, 2: 3201}[kind]

    def power(h):
        raise NVMLError("Not Supported")

    m.nvmlDeviceGetPowerUsage = power
    m.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    m.nvmlDeviceGetTemperature = lambda h, sensor: 41
    reasons = lambda h: throttle  # noqa: E731
    if new_names:
        m.nvmlDeviceGetCurrentClocksEventReasons = reasons
    else:
        m.nvmlDeviceGetCurrentClocksThrottleReasons = reasons
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=other_pid, usedGpuMemory=7029 * MIB),
        types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=100 * MIB)]
    m.nvmlSystemGetProcessName = lambda pid: b"python3"
    return m, calls


@pytest.mark.parametrize("new_names", [True, False])
def test_readings_through_the_nvml_bindings(monkeypatch, new_names):
    """pynvml present: the clocks, the power limit in watts (the draw unsupported: None, not an error), the
    temperature, the throttle mask by name (either name of NVML's call), the other processes in MiB (this one
    left out), and NVML shut down again."""
    module, calls = fake_pynvml(new_names=new_names)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setenv("PATH", "")  # (nvidia-smi would not be reached anyway)
    reading = gpu_readings.read()
    assert reading["source"] == "pynvml" and reading["error"] is None
    assert reading["name"] == "NVIDIA H200" and reading["driver"] == "570.86.15"
    assert (reading["sm_clock_mhz"], reading["sm_clock_max_mhz"]) == (1755, 1980)
    assert (reading["mem_clock_mhz"], reading["mem_clock_max_mhz"]) == (3201, 3201)
    assert reading["power_w"] is None and reading["power_limit_w"] == 700.0 and reading["temperature_c"] == 41
    assert reading["throttle_mask"] == 0x24 and reading["throttle_reasons"] == ["sw_power_cap", "sw_thermal_slowdown"]
    assert reading["processes"] == [{"pid": 4242, "name": "python3", "used_mib": 7029}]
    assert calls == ["init", "shutdown"]
    line = gpu_readings.line(reading)
    assert line.startswith("NVIDIA H200 (pynvml): SM 1,755/1,980 MHz") and "? W of 700 W" in line
    assert "throttle: sw_power_cap, sw_thermal_slowdown" in line and "4242 python3 (7029 MiB)" in line


FAKE_SMI = """#!{python}
import os, sys
args = sys.argv[1:]
query = next((a for a in args if a.startswith("--query-gpu=")), "")
if "power.draw" in query and os.environ.get("FAKE_SMI_OLD"):  # (a driver that knows no such field)
    print("Field power.draw is not a valid field to query.", file=sys.stderr)
    sys.exit(2)
if "clocks_event_reasons.active" in query:
    print("Field \\"clocks_event_reasons.active\\" is not a valid field to query.", file=sys.stderr)
    sys.exit(2)
if query == "--query-gpu=uuid":
    print("GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0")
elif query:
    fields = query.split("=", 1)[1].split(",")
    values = {{"name": "NVIDIA H200", "driver_version": "570.86.15", "clocks.sm": "1980", "clocks.max.sm": "1980",
              "clocks.mem": "3201", "clocks.max.mem": "3201", "power.draw": "612.43", "power.limit": "700.00",
              "temperature.gpu": "58", "clocks_throttle_reasons.active": "0x0000000000000004"}}
    print(", ".join(values[f] for f in fields))
elif any(a.startswith("--query-compute-apps=") for a in args):
    print("GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0, 1234, /usr/bin/python3, 7029")
    print("GPU-ffffffff-4f50-6172-8394-a5b6c7d8e9f0, 999, other-gpu, 10")
    print("GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0, {me}, this-process, 80")
else:
    sys.exit(9)
"""


def test_readings_through_nvidia_smi_when_the_bindings_are_missing(tmp_path, monkeypatch):
    """No pynvml: nvidia-smi's CSV, as a real one prints it (the throttle field under the name this driver
    knows, tried after the other; a field it does not know at all, None, the rest read one at a time), the
    processes on this GPU only (not another GPU's, not this process)."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI.format(python=sys.executable, me=os.getpid()))
    smi.chmod(0o755)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # (import pynvml raises ImportError)
    monkeypatch.setenv("PATH", str(tmp_path))
    reading = gpu_readings.read()
    assert reading["source"] == "nvidia-smi" and reading["error"] is None
    assert reading["name"] == "NVIDIA H200" and reading["driver"] == "570.86.15"
    assert (reading["sm_clock_mhz"], reading["sm_clock_max_mhz"], reading["mem_clock_mhz"]) == (1980, 1980, 3201)
    assert reading["power_w"] == 612.43 and reading["power_limit_w"] == 700.0 and reading["temperature_c"] == 58
    assert reading["throttle_reasons"] == ["sw_power_cap"]
    assert reading["processes"] == [{"pid": 1234, "name": "/usr/bin/python3", "used_mib": 7029}]
    without = gpu_readings.read(processes=False)
    assert "processes" not in without and without["sm_clock_mhz"] == 1980
    # a driver that does not know one of the fields: the others read one at a time, that one None
    monkeypatch.setenv("FAKE_SMI_OLD", "1")
    older = gpu_readings.read(processes=False)
    assert older["source"] == "nvidia-smi" and older["power_w"] is None and older["power_limit_w"] == 700.0
    assert older["sm_clock_mhz"] == 1980 and older["name"] == "NVIDIA H200" and older["throttle_reasons"] == ["sw_power_cap"]
    # a failing nvidia-smi: said in one line, no exception
    smi.write_text(textwrap.dedent("""\
        #!/bin/sh
        echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." >&2
        exit 9
    """))
    failed = gpu_readings.read()
    assert failed["source"] is None and failed["error"].startswith("nvidia-smi: nvidia-smi --query-gpu")
    assert "couldn't communicate" in failed["error"] and "\n" not in failed["error"]


def test_neither_the_bindings_nor_nvidia_smi_is_said_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setenv("PATH", str(tmp_path))  # (an empty folder)
    reading = gpu_readings.read()
    assert reading == {"source": None, "error": gpu_readings.MISSING}
    assert gpu_readings.line(reading) == gpu_readings.MISSING and "\n" not in gpu_readings.MISSING
    assert "nvidia-ml-py" in gpu_readings.MISSING and "nvidia-smi" in gpu_readings.MISSING
    with gpu_readings.Sampler(interval_s=0.01) as sampler:
        pass
    assert sampler.summary() == {"samples": 0, "error": gpu_readings.MISSING}


def test_a_sampler_summarises_the_readings_taken_while_something_runs():
    """The clocks' spread, the most power and heat, every throttle reason seen, from readings on a thread."""
    readings = iter([{"source": "pynvml", "sm_clock_mhz": clock, "sm_clock_max_mhz": 1980, "mem_clock_mhz": 3201,
                      "power_w": power, "power_limit_w": 700.0, "temperature_c": heat, "throttle_reasons": why}
                     for clock, power, heat, why in [(1980, 600.0, 50, []), (1755, 699.0, 55, ["sw_power_cap"]),
                                                     (1830, 690.0, 54, ["sw_power_cap"])]])
    taken = []

    def reader(index, processes):
        reading = next(readings, None)
        if reading is None:
            return {"source": None, "error": "done"}
        taken.append(reading)
        return reading

    sampler = gpu_readings.Sampler(interval_s=0.0, reader=reader)
    with sampler:
        while len(taken) < 3:
            pass
    summary = sampler.summary()
    assert summary["samples"] == 3 and summary["sm_clock_mhz"] == {"min": 1755, "median": 1830, "max": 1980}
    assert summary["power_w_max"] == 699.0 and summary["temperature_c_max"] == 55
    assert summary["throttle_reasons"] == ["sw_power_cap"]
    assert gpu_readings.sampled_line(summary).startswith("SM 1,755-1,980 MHz (median 1,830 of max 1,980)")


def test_throttle_masks_by_name():
    assert gpu_readings.reasons(0) == [] and gpu_readings.reasons(None) is None
    assert gpu_readings.reasons(0x1 | 0x40 | 0x1000) == ["gpu_idle", "hw_thermal_slowdown", "0x1000"]
