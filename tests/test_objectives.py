"""The objectives as plug-ins (gptkit/objectives/) and a run's state as one object (gptkit/run.py): the names
config.py offers are the registered ones; a part of the run that registers a state is saved under its key and
handed back on resume, with no keyword of build_checkpoint; an objective whose step cannot be captured turns
CUDA graphs away in one line. (DPO through all of it: tests/test_dpo_train.py.)"""

from types import SimpleNamespace

import pytest
import torch

from gptkit import runtime
from gptkit.checkpoint import build_checkpoint, load_checkpoint, save_checkpoint
from gptkit.config import OBJECTIVE_NAMES, TrainConfig
from gptkit.objectives import OBJECTIVES, ObjectiveError, make_objective
from gptkit.objectives.next_token import NextToken
from gptkit.optim import make_optimizer
from gptkit.run import Run
from gptkit.runtime import DeviceError, Dist, setup_runtime
from gptkit.shards import read_meta
from model import GPT


def test_the_names_config_offers_are_the_registered_objectives():
    """config.py lists the names without importing the objectives (it stands below them): the two must agree,
    and each name makes its own class."""
    assert set(OBJECTIVE_NAMES) == set(OBJECTIVES)
    for name in OBJECTIVE_NAMES:
        objective = make_objective(TrainConfig(objective=name, init_from="gpt2"))
        assert type(objective) is OBJECTIVES[name] and objective.name == name
    with pytest.raises(ObjectiveError, match="objective must be one of next_token, dpo"):
        make_objective(SimpleNamespace(objective="reward_model"))


class Counted(NextToken):
    """The next-token loss with a state of its own (the micro-batches it has scored), saved in checkpoints."""

    name = "counted"
    state_key = "counted_state"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.scored = torch.zeros((), dtype=torch.int64)

    def start(self, cfg, raw_model, data_dir, state, d, rt) -> str:
        if state is not None:
            self.scored = state["scored"].clone()
        return ""

    def state_dict(self):
        return {"scored": self.scored.clone()}


def make_run(cfg, data_dir, objective) -> Run:
    torch.manual_seed(0)
    rt, d = setup_runtime("cpu", "float32"), Dist()
    meta = read_meta(data_dir)
    model = GPT(cfg.model_config(int(meta["vocab_size"]), vocab_multiple=1))
    loader, val = objective.batches(cfg, data_dir, d, rt)
    return Run(cfg=cfg, argv=[], d=d, rt=rt, meta=meta, raw_model=model, model=model,
               optimizer=make_optimizer(model, cfg, "cpu"), scaler=torch.amp.GradScaler("cpu", enabled=False),
               loader=loader, val=val, accum=1, objective=objective)


def test_a_registered_part_is_saved_under_its_key_and_read_back(char_dataset, tmp_path):
    """Run.state_dict holds what every checkpoint holds plus each registered part's state under its key (the
    objective's); the file written and read back gives the part its state, and the loader its position. A run
    whose objective has no state saves no such key."""
    cfg = TrainConfig(dataset=str(char_dataset), block_size=16, batch_size=2, n_layer=1, n_head=2, n_embd=16,
                      dropout=0.0, out_dir=str(tmp_path / "out"))
    objective = Counted(cfg)
    run = make_run(cfg, char_dataset, objective)
    run.loader.next_batch()
    objective.scored += 5
    state = run.state_dict(step=3, best_val=1.5)
    assert torch.equal(state["counted_state"]["scored"], torch.tensor(5))
    assert state["step"] == 3 and state["best_val_loss"] == 1.5 and len(state["rng"]) == 1
    save_checkpoint(state, tmp_path / "last.pt")

    ckpt = load_checkpoint(tmp_path / "last.pt", mmap=False)
    again = Counted(cfg)
    again.start(cfg, None, char_dataset, ckpt.get(again.state_key), Dist(), None)
    assert torch.equal(again.scored, torch.tensor(5))
    resumed = make_run(cfg, char_dataset, again)
    assert resumed.load_state_dict(ckpt) == (3, 1.5)
    assert resumed.loader.state_dict() == run.loader.state_dict()

    plain = make_run(cfg, char_dataset, NextToken(cfg)).state_dict(step=0, best_val=float("inf"))
    assert not {"counted_state", "dpo_reference"} & set(plain)


def test_a_part_may_not_take_a_key_the_checkpoint_uses(char_dataset, tmp_path):
    cfg = TrainConfig(dataset=str(char_dataset), block_size=16, batch_size=2, n_layer=1, n_head=2, n_embd=16)
    run = make_run(cfg, char_dataset, NextToken(cfg))
    with pytest.raises(ValueError, match="'step'"):
        build_checkpoint(model=run.raw_model, optimizer=run.optimizer, scaler=run.scaler, loader=run.loader,
                         meta=run.meta, config={}, argv=[], step=0, best_val_loss=0.0, rng=[], versions={},
                         states={"step": {"a": 1}})


def test_an_objective_that_cannot_be_captured_turns_cuda_graphs_away(monkeypatch):
    """graphable = False (an objective drawing new data inside its step): --cuda_graphs=True is a one-line
    error naming it, auto says what it would need; a graphable objective is captured as before."""
    monkeypatch.setattr(runtime, "GRAPH_DEVICE_TYPES", ("cpu",))
    rt = setup_runtime("cpu", "float32")
    common = dict(world_size=1, optimizer="adamw", compiled=False)
    assert runtime.resolve_cuda_graphs(True, rt, **common)[0]
    with pytest.raises(DeviceError, match="objective=grpo draws new data in its step") as e:
        runtime.resolve_cuda_graphs(True, rt, ungraphable="grpo", **common)
    assert "\n" not in str(e.value)
    on, line = runtime.resolve_cuda_graphs(None, rt, ungraphable="grpo", **common)
    assert not on and "objective=grpo" in line
