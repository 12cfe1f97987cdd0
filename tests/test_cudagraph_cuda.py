"""train.py's whole step as one CUDA graph, on a GPU (tests/test_cudagraph.py checks the same arithmetic eagerly
on the CPU; only here is the step captured and replayed): the graphed run's steps equal the plain step's from one
seed, eager and compiled with dropout (the random masks drawn inside the graph; and directly: a compiled dropout
captured and replayed draws the plain run's masks); a NaN that enters after the capture masks that step and every
later one; an asynchronous save pending at the capture does not break it; a DPO step, with either reference,
captured as well. gpu_check's tests part runs this file first, on its own, each test within a time limit."""

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import train_script

from gptkit import optim
from gptkit.checkpoint.background import CheckpointSaver
from gptkit.cudagraph import GraphedStep
from tests.test_train import assert_same_weights, tiny_args, train_losses, weights

train = train_script()

pytestmark = pytest.mark.cuda  # skipped without a CUDA GPU (tests/ci_skips.py)

# the tiny model on the GPU, eager (no compile: the capture of the plain step is what is tested, in seconds)
ON_GPU = dict(device="cuda", compile=False, dropout=0.0, eval_interval=100)


def count_captures(monkeypatch) -> list[int]:
    """Every capture from now on appends the step count at which it happened."""
    captured = []
    real = GraphedStep._capture

    def capture(self):
        captured.append(self.steps)
        real(self)

    monkeypatch.setattr(GraphedStep, "_capture", capture)
    return captured


def same_float32_lr(monkeypatch) -> None:
    """The graph's learning rate is a float32 tensor: the plain run gets the same rounding."""
    real_lr = optim.get_lr
    monkeypatch.setattr(optim, "get_lr", lambda step, cfg: torch.tensor(real_lr(step, cfg)).item())


def assert_same_run(plain, graphed, steps: int, trained: bool = True) -> None:
    """The graphed run's loss at every step is the plain run's to bf16 rounding, and so are its final weights
    (each tensor's difference small against the tensor: a step replayed on stale inputs or with a stale dropout
    mask, or a lost update, would change the weights by as much as training does)."""
    a, b = train_losses(plain), train_losses(graphed)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=2e-2), step
    if trained:
        assert sum(a[s] for s in range(steps - 4, steps + 1)) < sum(a[s] for s in range(1, 6)) - 1.0
    wa, wb = weights(plain), weights(graphed)
    assert wa.keys() == wb.keys()
    for name in wa:
        diff = (wa[name].float() - wb[name].float()).norm() / wa[name].float().norm()
        assert diff < 2e-2, (name, float(diff))


def generator_offset() -> int:
    """How far the CUDA generator has gone: equal after two runs from one seed where they drew the same random
    numbers, and short in a graphed run whose replays drew none (masks baked into the graph: the same every
    step). A replay advances it by what the capture recorded, as the step run plainly would."""
    return int(torch.cuda.default_generators[torch.cuda.current_device()].get_offset())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_cuda_graphed_training_is_the_plain_step_bit_for_bit(char_dataset, tmp_path, monkeypatch, dropout):
    """30 steps from one seed, bf16, eager, with and without dropout: the step captured once after the three
    warm-up steps, and every replay the plain step to the bit (losses, weights and the random numbers drawn:
    each replay's dropout masks are the plain step's; measured so on an H200)."""
    same_float32_lr(monkeypatch)
    captured = count_captures(monkeypatch)
    plain, graphed = tmp_path / "plain", tmp_path / "graphed"
    args = dict(ON_GPU, dropout=dropout, max_iters=30, lr_decay_iters=30, seed=1234, learning_rate=1e-2,
                min_lr=1e-3)
    train.main(tiny_args(char_dataset, plain, cuda_graphs=False, **args))
    plain_offset = generator_offset()
    assert captured == []
    train.main(tiny_args(char_dataset, graphed, cuda_graphs=True, **args))
    assert captured == [3]  # captured once, after the three warm-up steps, and replayed from there on
    assert generator_offset() == plain_offset
    assert train_losses(graphed) == train_losses(plain)
    assert_same_weights(weights(plain), weights(graphed))
    assert_same_run(plain, graphed, 30)  # (and it trained)


def test_cuda_compiled_graphed_training_with_dropout_is_the_plain_step(char_dataset, tmp_path, monkeypatch):
    """The compiled capture, as bench.py's graphed row and gpu_check's steps and shakespeare parts run it:
    torch.compile's model with dropout 0.1, the masks drawn inside the graph. Captured once (a recompile inside
    the capture would fail naming its guard), the warm-up steps the plain ones to the bit, each replay drawing
    the random numbers the plain step draws (a mask baked into the graph would draw none), and the run the
    plain run to rounding. Not to the bit: inductor's captured step parts from the plain one by rounding from
    the first replay, with or without dropout (on an H200: 5e-6 in the loss at step 6, 2e-4 by step 29, the
    weight matrices 3e-3 to 7e-3 apart; the zero-initialised biases, whose near-zero gradients AdamW turns into
    full-sized steps of either sign, 0.5-0.8 apart, as two plain runs on different hardware would be)."""
    same_float32_lr(monkeypatch)
    captured = count_captures(monkeypatch)
    plain, graphed = tmp_path / "plain", tmp_path / "graphed"
    args = dict(ON_GPU, compile=True, dropout=0.1, max_iters=30, lr_decay_iters=30, seed=1234, learning_rate=1e-2,
                min_lr=1e-3)
    train.main(tiny_args(char_dataset, plain, cuda_graphs=False, **args))
    plain_offset = generator_offset()
    assert captured == []
    train.main(tiny_args(char_dataset, graphed, cuda_graphs=True, **args))
    assert captured == [3]
    assert generator_offset() == plain_offset
    a, b = train_losses(plain), train_losses(graphed)
    assert sorted(a) == sorted(b) == list(range(1, 31))
    assert [b[step] for step in (1, 2, 3)] == [a[step] for step in (1, 2, 3)]  # the warm-up steps
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=2e-3), step
    assert sum(a[s] for s in range(26, 31)) < sum(a[s] for s in range(1, 6)) - 1.0  # (and it trained)
    wa, wb = weights(plain), weights(graphed)
    assert wa.keys() == wb.keys()
    for name in (name for name in wa if wa[name].dim() >= 2):  # the matrices (the vectors: see above)
        diff = (wa[name].float() - wb[name].float()).norm() / wa[name].float().norm()
        assert diff < 2e-2, (name, float(diff))


def test_cuda_a_compiled_dropout_captured_draws_the_plain_masks_at_each_replay():
    """The direct case under the compiled capture with dropout: torch.compile's F.dropout of a tensor of ones,
    captured in one CUDA graph and replayed three times. Each replay draws a new mask (none baked into the graph:
    the three differ) and advances the CUDA generator, and each is the mask the same compiled function draws
    run plainly from the generator offset that replay started at (inductor's random numbers follow the
    generator's offset, captured or not)."""
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    dropout = torch.compile(lambda x: F.dropout(x, p=0.5, training=True))
    ones = torch.ones(64, 1024, device="cuda")
    torch.manual_seed(1234)
    side = torch.cuda.Stream()  # (the warm-up, which compiles, on a side stream, as a capture wants)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            dropout(ones)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dropout(ones)
    offsets, masks = [], []
    for _ in range(3):
        offsets.append(generator.get_offset())
        graph.replay()
        masks.append(out.clone())
    assert len(set(offsets)) == 3 and generator.get_offset() > offsets[-1]  # (each replay advanced it)
    for mask in masks:  # a dropout of ones: 0 or 1 / (1 - p), about half of each
        assert set(mask.unique().tolist()) == {0.0, 2.0} and 0.45 < float((mask == 0).float().mean()) < 0.55
    assert not any(torch.equal(masks[i], masks[j]) for i, j in ((0, 1), (0, 2), (1, 2)))
    for offset, mask in zip(offsets, masks):
        generator.set_offset(offset)
        assert torch.equal(dropout(ones), mask)


def test_cuda_an_asynchronous_save_pending_at_the_capture_does_not_break_it(char_dataset, tmp_path, monkeypatch):
    """--async_save=True with an evaluation at step 3 (a warm-up step's end): best.pt and last.pt are saved in
    the background just before step 3 is captured. The writer thread's wait for its copies to the pinned buffers
    (events synchronised) must not fall inside the capture, which capture_error_mode="global" refuses: here the
    writer of a save made before the capture is held until the capture has begun (or 1 s), so that unless the
    capture waits for a pending save first (or captures thread-locally) this fails every time, not by chance.
    The run completes, captured once, its steps and weights those of the same run saving synchronously."""
    same_float32_lr(monkeypatch)
    captured = count_captures(monkeypatch)
    capturing = threading.Event()
    real_copy, real_graph = CheckpointSaver._copy, torch.cuda.graph

    def copy(self, obj):
        snapshot, ready = real_copy(self, obj)
        if ready is None or captured:  # (decided now, in the loop's thread: a save before the capture is held)
            return snapshot, ready

        def held():
            capturing.wait(timeout=1.0)
            ready()

        return snapshot, held

    class graph(real_graph):
        def __enter__(self):
            super().__enter__()
            capturing.set()

    monkeypatch.setattr(CheckpointSaver, "_copy", copy)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    args = dict(ON_GPU, eval_interval=3, max_iters=12, lr_decay_iters=12, seed=1234, learning_rate=1e-2,
                min_lr=1e-3, cuda_graphs=True)
    background, synchronous = tmp_path / "background", tmp_path / "synchronous"
    train.main(tiny_args(char_dataset, synchronous, async_save=False, **args))
    assert captured == [3]
    train.main(tiny_args(char_dataset, background, async_save=True, **args))
    assert captured == [3, 3] and capturing.is_set()
    assert_same_run(synchronous, background, 12, trained=False)


def test_cuda_a_nan_after_the_capture_masks_that_step_and_every_later_one(char_dataset, tmp_path, monkeypatch):
    """A weight made NaN on the device for the 7th step only (step 6, the third replay): that step's update is
    masked inside the graph, and so is every later one although the weight is finite again (the flag on the
    device stays set), until train.py reads the flag and stops with the one-line error. The weights at the end
    are those from before step 6, exactly."""
    captured = count_captures(monkeypatch)
    seen = {}
    real_call = GraphedStep.__call__

    def call(self, loader, stop_requested):
        seen["calls"] = seen.get("calls", 0) + 1
        if seen["calls"] != 7:
            return real_call(self, loader, stop_requested)
        seen["step"], seen["before"] = self, [p.detach().clone() for p in self.params]
        poisoned = self.params[0]  # read by the graph at its address: the replay sees the NaN
        kept = poisoned.detach().clone()
        with torch.no_grad():
            poisoned.fill_(float("nan"))
        outputs = real_call(self, loader, stop_requested)
        with torch.no_grad():
            poisoned.copy_(kept)  # (on the same stream: after this replay, before the next)
        return outputs

    monkeypatch.setattr(GraphedStep, "__call__", call)
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="non-finite loss or gradient norm at step 6"):
        train.main(tiny_args(char_dataset, out, cuda_graphs=True, max_iters=20, lr_decay_iters=20, **ON_GPU))
    assert captured == [3] and seen["calls"] >= 8  # the replays after the NaN ran (the flag is read a step late)
    step = seen["step"]
    assert float(step.halted) == 1.0
    for p, before in zip(step.params, seen["before"]):
        assert torch.equal(p, before)


@pytest.fixture(scope="module")
def dpo_task(tmp_path_factory):
    """tests/test_dpo_train.py's small synthetic preference task: a tiny chat model and its pairs (on the CPU)."""
    from tests import test_dpo_train

    root = tmp_path_factory.mktemp("rule")
    test_dpo_train.prepare_task(root, n_sft=300, n_pairs=200)
    train.main(test_dpo_train.sft_args(root / "data" / "sft", root / "sft"))
    return root / "sft", test_dpo_train.prepare_pairs(root, root / "sft")


def test_cuda_the_captured_dpo_step_trains_as_the_plain_step(dpo_task, tmp_path, monkeypatch):
    """objective=dpo, bf16, eager, 20 steps, with each reference: the full fine-tune's precomputed log-probabilities
    copied into the graph's inputs with each batch's tokens, and LoRA's adapters-off forward (eval mode, no
    gradients) recorded inside the graph. Each run captured once, after the three warm-up steps, and equal to the
    plain step's run to bf16 rounding."""
    from tests.test_dpo_train import dpo_args

    same_float32_lr(monkeypatch)
    captured = count_captures(monkeypatch)
    sft, pairs = dpo_task
    task = SimpleNamespace(sft=sft, pairs=pairs)
    for name, over in (("precomputed", {}), ("lora", dict(lora_rank=4, lora_dropout=0.0))):
        plain, graphed = tmp_path / f"{name}_plain", tmp_path / f"{name}_graphed"
        args = dict(device="cuda", dtype="bfloat16", max_iters=20, lr_decay_iters=20, eval_interval=100, **over)
        train.main(dpo_args(task, plain, cuda_graphs=False, **args))
        train.main(dpo_args(task, graphed, cuda_graphs=True, **args))
        assert captured == [3], name
        captured.clear()
        assert_same_run(plain, graphed, 20, trained=False)
