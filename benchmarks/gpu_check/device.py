"""The device part, first of every run and on its own budget: NVML's readings of the GPU as the check starts
(benchmarks/gpu_readings.py), then, from a child process (the check itself imports no torch), the device, its
versions and the dense matmul peak at two shapes with NVML read while each ran."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from benchmarks import gpu_readings  # (standard library only, as gptkit.cli)
from benchmarks.gpu_check.check import Check, outcome
from benchmarks.gpu_check.common import python, shown
from benchmarks.gpu_check.figures import h200, on_h200

# The matmul peak: PEAK_WARMUP_S of warm-up on the first shape (ten products, ~15 ms, read 725 TFLOP/s on the
# H200 against the 788-798 that H200s give once their clocks are up, and 1 s read 607 on the slower host of
# 2026-11-28, with nothing to say why), then each shape timed for ~PEAK_TIMED_S while NVML is read on a thread;
# the second shape gets PEAK_SHAPE_WARMUP_S of its own first. The first is the denominator of mfu_measured_peak.
PEAK_WARMUP_S = {False: 3.0, True: 0.1}
PEAK_SHAPE_WARMUP_S = {False: 0.5, True: 0.05}
PEAK_TIMED_S = {False: 1.0, True: 0.1}
# (m, k, n) of each product: 8192^3, and GPT-2's MLP up-projection at 12 x 1024 tokens (in --smoke, on the CPU in
# float32, shapes a CPU times in a moment)
PEAK_SHAPES = {False: (("8192^3", (8192, 8192, 8192)), ("GPT-2's 12,288 x 768 x 3,072", (12288, 768, 3072))),
               True: (("512^3", (512, 512, 512)), ("GPT-2's shape / 16", (768, 48, 192)))}


def device_command(smoke: bool, out: Path) -> list[str]:
    """The child that reads the device and times the peak (child_peak), writing its JSON to `out`."""
    return python("-m", "benchmarks.gpu_check", "--child=peak", f"--child_out={out}", *(["--smoke"] if smoke else []))


def part_device(check: Check, args) -> dict:
    """NVML's readings of the GPU as the check starts (clocks, power, temperature, throttle reasons, other
    processes: benchmarks/gpu_readings.py, here, before anything has warmed it), then the device, the versions
    and the measured dense peaks at two shapes with the readings taken while each ran, from a child process
    (this one imports no torch)."""
    reading = gpu_readings.read()
    check.report["readings"] = {"start": reading, "line": gpu_readings.line(reading)}
    check.note(f"\n===== NVML's readings at the start: {check.report['readings']['line']}\n")
    print(f"  readings: {check.report['readings']['line']}", flush=True)
    out = check.tmp / "peak.json"
    run = check.run("device and matmul peaks", device_command(check.smoke, out))
    info = json.loads(out.read_text()) if out.is_file() else {}
    check.report["device"] = info
    check.report["torch"] = info.get("torch")
    status, reason = outcome([run], ["the matmul peak"])
    if status == "ok" and not check.smoke and not info.get("cuda_available"):
        status, reason = "failed", "no CUDA device here (torch.cuda.is_available() is False)"
    return {"status": status, "reason": reason, "runs": [run.record()] if run else [], "peak": info.get("peak"),
            "peaks": info.get("peaks")}


def child_peak(smoke: bool) -> dict:
    """The device, its versions and its measured dense peaks (bf16 on a GPU; float32 on the CPU in --smoke): after
    PEAK_WARMUP_S of warm-up (the clocks up), each of PEAK_SHAPES timed for ~PEAK_TIMED_S in batches, NVML read
    on a thread meanwhile (gpu_readings.Sampler), in TFLOP/s. "peak" is the first shape's (8192^3: the
    denominator of mfu_measured_peak), "peaks" every shape's."""
    import torch

    from gptkit.metrics import peak_flops_for

    info = {"python": platform.python_version(), "torch": str(torch.__version__), "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    on_gpu = info["cuda_available"] and not smoke
    if on_gpu:
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                    cudnn=torch.backends.cudnn.version())
    elif smoke:
        info.update(name=platform.processor() or platform.machine(), cpu_threads=torch.get_num_threads())
    else:
        return info
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    datasheet = peak_flops_for(info["name"], dtype) if on_gpu else None
    index = torch.cuda.current_device() if on_gpu else 0
    info["peaks"] = []

    def products(a, b, count: int) -> float:  # (the host waits: the products counted are those the device has done)
        t0 = time.perf_counter()
        for _ in range(count):
            a @ b
        sync()
        return time.perf_counter() - t0

    for i, (name, (m, k, n)) in enumerate(PEAK_SHAPES[smoke]):
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        warmup_s = PEAK_WARMUP_S[smoke] if i == 0 else PEAK_SHAPE_WARMUP_S[smoke]
        warm, warmup_products, spent = time.perf_counter() + warmup_s, 0, 0.0
        while time.perf_counter() < warm:
            spent += products(a, b, 10)
            warmup_products += 10
        batch = max(10, round(warmup_products / max(spent, 1e-9) * PEAK_TIMED_S[smoke] / 5))  # five timed batches
        with gpu_readings.Sampler(index) as sampler:
            seconds = sum(products(a, b, batch) for _ in range(5)) / (5 * batch)
        clocks = sampler.summary()
        info["peaks"].append({"shape": name, "mkn": [m, k, n], "dtype": str(dtype).removeprefix("torch."),
                              "tflops_measured": 2 * m * k * n / seconds / 1e12,
                              "tflops_datasheet": datasheet / 1e12 if datasheet else None,
                              "warmup_s": warmup_s, "warmup_products": warmup_products, "timed_products": 5 * batch,
                              "clocks": clocks, "clocks_line": gpu_readings.sampled_line(clocks)})
        del a, b
    info["peak"] = {"n": PEAK_SHAPES[smoke][0][1][0], **info["peaks"][0]}
    return info


def run_needs(smoke: bool) -> list[tuple[str, float]]:
    """NVML's readings, then the child's start and the matmul peak's warm-up and timing."""
    timed = PEAK_WARMUP_S[False] + PEAK_SHAPE_WARMUP_S[False] + len(PEAK_SHAPES[False]) * PEAK_TIMED_S[False]
    return on_h200([("NVML's readings", h200("readings_s")), ("device and matmul peak", h200("torch_start_s") + timed)],
                   smoke)


def commands(smoke: bool) -> list[str]:
    return ["NVML's readings (pynvml, else nvidia-smi --query-gpu=... and --query-compute-apps=...)",
            shown(device_command(smoke, Path("TMP") / "peak.json"))]
