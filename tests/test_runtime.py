"""gptkit/runtime.py's choices for a GPU, exercised on the CPU with stand-ins for torch.cuda's queries."""

import pytest
import torch

from gptkit import runtime
from gptkit.runtime import DeviceError, process_device, resolve_dtype

CUDA = torch.device("cuda", 0)


def fake_bf16_support(monkeypatch, native: bool) -> None:
    """torch 2.13's is_bf16_supported: True for an emulating GPU (T4, V100) unless including_emulation=False."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native or including_emulation)


def test_auto_dtype_is_fp16_on_a_gpu_that_only_emulates_bf16(monkeypatch):
    fake_bf16_support(monkeypatch, native=False)
    assert resolve_dtype("auto", CUDA) == torch.float16
    with pytest.raises(DeviceError, match="emulated.*float16"):
        resolve_dtype("bfloat16", CUDA)


def test_auto_dtype_is_bf16_on_ampere_and_newer(monkeypatch):
    fake_bf16_support(monkeypatch, native=True)
    assert resolve_dtype("auto", CUDA) == torch.bfloat16
    assert resolve_dtype("bfloat16", CUDA) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_torchrun_process_takes_the_gpu_of_its_local_rank():
    assert process_device("auto", 3, cuda_available=True) == "cuda:3"
    assert process_device("cuda", 1, cuda_available=True) == "cuda:1"
    assert process_device("auto", 1, cuda_available=False) == "cpu"
    assert process_device("cpu", 1, cuda_available=True) == "cpu"


def test_torchrun_refuses_one_explicit_gpu_for_every_process(monkeypatch):
    with pytest.raises(DeviceError, match="every process.*CUDA_VISIBLE_DEVICES"):
        process_device("cuda:0", 2, cuda_available=True)
    # Through distributed(): refused before any process group is made.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime.dist, "init_process_group", lambda **kw: pytest.fail("no group should be made"))
    with pytest.raises(DeviceError, match="cuda:0"):
        with runtime.distributed("cuda:0"):
            pass
