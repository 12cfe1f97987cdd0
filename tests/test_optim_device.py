"""Resuming AdamW's state where another machine saved it: after load_optimizer_state every state tensor sits
where this optimizer's implementation keeps it, whatever the saving machine's flags were.

torch keeps AdamW's `step` on the parameter's device, in float32, when the group is fused or capturable, and on
the CPU otherwise (its note "special device hosting for step"); the other state (the moments) follows the
parameter. load_state_dict places `step` by the *saved* groups' flags, before keeping_implementation gives the
groups this machine's flags back, so without a re-placement a run saved on a CPU (neither flag) resumes on a GPU
with `step` on the CPU, which fused and capturable AdamW refuse or mis-read.

On a machine without a GPU the meta device stands in for it: a device that is not the CPU, to which `.to()`
moves a tensor (and nothing is computed). Where the CPU can run the resumed optimizer, it takes a step, and a
fresh optimizer of the same implementation stepping once is the oracle of where its state belongs."""

import pytest
import torch

from gptkit.config import TrainConfig
from gptkit.optim import MuonAdamW, load_optimizer_state, make_optimizer
from model import GPT, GPTConfig

CFG = TrainConfig(learning_rate=1e-2, weight_decay=0.1)
CUDA_FLAGS = {"fused": True, "capturable": True}  # a GPU run's graphable AdamW (make_adamw, graphable=True)


def tiny(device: str = "cpu") -> GPT:
    """A one-block GPT on `device` (made there: its tied embedding and head stay one parameter)."""
    torch.manual_seed(0)
    with torch.device(device):
        return GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8, dropout=0.0, bias=True))


def trained_state(optimizer_kind: str = "adamw") -> dict:
    """Two CPU steps of the plain CPU optimizer, its state dict as a checkpoint holds it (torch.save, then
    torch.load onto the CPU, as every checkpoint reader here loads it)."""
    cfg = TrainConfig(**{**CFG.__dict__, "optimizer": optimizer_kind})
    model = tiny()
    opt = make_optimizer(model, cfg, "cpu")
    x = torch.randint(0, 16, (2, 8))
    for _ in range(2):
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return roundtrip(opt.state_dict())


def roundtrip(state: dict) -> dict:
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu", weights_only=True)


def as_a_gpu_run_saves_it(state: dict) -> dict:
    """The same state as a GPU run with the graphable AdamW leaves it in a checkpoint: its groups fused and
    capturable, the learning rate a tensor, `step` in float32 (on the GPU when saved; loaded onto the CPU)."""
    for group in state["param_groups"]:
        group.update(CUDA_FLAGS, lr=torch.tensor(float(group["lr"])))
    for entry in state["state"].values():
        entry["step"] = entry["step"].to(torch.float32)
    return state


def on_a_gpu(graphable: bool) -> torch.optim.AdamW:
    """make_optimizer's AdamW for CUDA, on the tiny model's parameters on the meta device. (The graphable one's
    learning-rate tensor cannot be made on meta, where AdamW's check of it would read its value: its flags and
    tensor are set as make_adamw sets them on CUDA, which the CPU confirms.)"""
    optimizer = make_optimizer(tiny("meta"), CFG, "cuda")
    if graphable:
        real = make_optimizer(tiny(), CFG, "cuda", graphable=True)  # (on CPU parameters: made, never stepped)
        for group, made in zip(optimizer.param_groups, real.param_groups):
            group.update(capturable=True, lr=torch.tensor(CFG.learning_rate, device="meta"))
            assert {k: group[k] for k in ("fused", "capturable", "foreach")} == {
                k: made[k] for k in ("fused", "capturable", "foreach")}
            assert isinstance(made["lr"], torch.Tensor)
    return optimizer


def adamws(optimizer) -> list[torch.optim.Optimizer]:
    return [optimizer.adamw] if isinstance(optimizer, MuonAdamW) else [optimizer]


def where_torch_keeps(group: dict, param: torch.Tensor, key: str) -> tuple[torch.device, torch.dtype | None]:
    """torch's placement of one AdamW state tensor for this group's implementation (None: any dtype)."""
    if key != "step":
        return param.device, param.dtype
    if group.get("fused") or group.get("capturable"):
        return param.device, torch.float32
    return torch.device("cpu"), None


def assert_placed(optimizer) -> None:
    """Every state tensor of every (AdamW) parameter where torch keeps it for this optimizer's flags."""
    checked = 0
    for opt in adamws(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, state.keys()
                for key, value in state.items():
                    device, dtype = where_torch_keeps(group, p, key)
                    assert value.device == device, (key, value.device, device, {k: group[k] for k in CUDA_FLAGS})
                    assert dtype is None or value.dtype == dtype, (key, value.dtype, dtype)
                    checked += 1
    assert checked >= 9  # (3 tensors for each of the tiny model's parameters)


@pytest.mark.parametrize("graphable", [False, True])
def test_a_cpu_checkpoint_resumed_on_a_gpu_puts_step_on_the_device(graphable):
    """Saved on a CPU (neither fused nor capturable: `step` on the CPU), resumed by the GPU's fused AdamW, and
    by its graphable one (fused and capturable, the learning rate a device tensor): `step` on the device in
    float32, the moments too, the flags and the learning-rate tensor this machine's."""
    state = trained_state()
    assert not any(g["fused"] or g["capturable"] for g in state["param_groups"])
    resumed = on_a_gpu(graphable)
    lrs = [g["lr"] for g in resumed.param_groups]
    load_optimizer_state(resumed, state)
    assert [g["fused"] for g in resumed.param_groups] == [True, True]
    assert [g["capturable"] for g in resumed.param_groups] == [graphable, graphable]
    if graphable:  # the very tensors a CUDA graph reads (filled with the checkpoint's value: test_cudagraph.py)
        assert all(g["lr"] is lr for g, lr in zip(resumed.param_groups, lrs))
    assert_placed(resumed)


def test_a_gpu_checkpoint_resumed_where_adamw_is_not_fused_puts_step_on_the_cpu():
    """Saved by a GPU run (fused, capturable), resumed on a device whose AdamW is neither (as on MPS, where
    FUSED_DEVICE_TYPES leaves the loop implementation): `step` goes where that implementation keeps it, the
    CPU, and the moments to the device."""
    resumed = make_optimizer(tiny("meta"), CFG, "mps")
    load_optimizer_state(resumed, as_a_gpu_run_saves_it(trained_state()))
    assert not any(g["fused"] or g["capturable"] for g in resumed.param_groups)
    assert all(isinstance(g["lr"], float) for g in resumed.param_groups)
    assert_placed(resumed)


@pytest.mark.parametrize("resumed_on", ["cpu", "cpu graphable"])
def test_a_gpu_checkpoint_resumed_on_the_cpu_steps_as_a_fresh_optimizer_would(resumed_on):
    """Saved by a GPU run (fused, capturable), resumed on the CPU by the plain AdamW and by the graphable one
    (fused on the CPU, its kernel wants `step` as float32 beside the parameter): the state is where a fresh
    optimizer of the same kind keeps it after a step, the resumed optimizer steps, and its step equals that
    of the optimizer resumed from the same state saved by a CPU run."""
    graphable = resumed_on.endswith("graphable")
    model, reference = tiny(), tiny()
    resumed = make_optimizer(model, CFG, "cpu", graphable=graphable)
    load_optimizer_state(resumed, as_a_gpu_run_saves_it(trained_state()))
    assert_placed(resumed)
    oracle = make_optimizer(reference, CFG, "cpu", graphable=graphable)
    load_optimizer_state(oracle, trained_state())
    fresh_model = tiny()
    fresh = make_optimizer(fresh_model, CFG, "cpu", graphable=graphable)
    x = torch.randint(0, 16, (2, 8))
    for m, opt in ((model, resumed), (reference, oracle), (fresh_model, fresh)):
        m(x, x)[1].backward()
        opt.step()
    for p, q, r in zip(model.parameters(), reference.parameters(), fresh_model.parameters()):
        assert torch.equal(p, q)
        for key, value in resumed.state[p].items():
            expected = fresh.state[r][key]
            assert (value.device, value.dtype) == (expected.device, expected.dtype), key
            assert torch.equal(value, oracle.state[q][key]), key


def test_muon_adamws_part_is_placed_too():
    """Muon + AdamW as one optimizer: a CPU checkpoint resumed on a GPU puts the AdamW part's `step` on the
    device as well (keeping_implementation reaches both optimizers' state), and Muon's momentum with its
    parameters."""
    resumed = make_optimizer(tiny("meta"), TrainConfig(**{**CFG.__dict__, "optimizer": "muon"}), "cuda")
    load_optimizer_state(resumed, trained_state("muon"))
    assert_placed(resumed)
    momenta = [resumed.muon.state[p] for g in resumed.muon.param_groups for p in g["params"]]
    assert momenta and all(s["momentum_buffer"].device.type == "meta" for s in momenta)
