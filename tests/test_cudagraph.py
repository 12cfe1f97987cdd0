"""train.py's whole-step CUDA graph path (gptkit/cudagraph.py), checked on the CPU: the graph's step runs eagerly
there with the same arithmetic (tensor learning rate, fused AdamW, the flags on the device, the masked update),
so everything but the capture itself is tested here: equal to the plain step, a NaN never applied, a stop at a
step boundary, exact resume. Also the host's per-step work staying flat, and regional compilation."""

import functools
import gc
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import train_script

from gptkit import optim, runtime
from gptkit.cudagraph import GraphedStep
from gptkit.runtime import DeviceError, Dist, Runtime, resolve_cuda_graphs
from gptkit.step import StepGuard
from tests.test_train import (
    REPO,
    assert_resume_matches_uninterrupted,
    assert_same_weights,
    poison_training_forward,
    record_masked_steps,
    tiny_args,
    train_losses,
    weights,
)

train = train_script()

GRAPHS_ON_CPU = """
import sys; sys.path.insert(0, "tests"); from conftest import train_script; train = train_script()
from gptkit import optim, runtime, step
step.DEFERRED_DEVICE_TYPES = optim.FUSED_DEVICE_TYPES = runtime.GRAPH_DEVICE_TYPES = ("cpu",)
"""


@pytest.fixture
def gpu_like(monkeypatch):
    """The CUDA choices on the CPU: fused AdamW, flags read a step late, and the graph path allowed."""
    monkeypatch.setattr("gptkit.step.DEFERRED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(optim, "FUSED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(runtime, "GRAPH_DEVICE_TYPES", ("cpu",))


def test_the_graph_step_trains_exactly_as_the_plain_step(char_dataset, tmp_path, monkeypatch, gpu_like):
    """Same losses every step, same weights at the end, bit for bit: the graph's step is the plain step with its
    learning rate in a tensor and its flags and update decided on the device. (The tensor is float32: the
    schedule's values are rounded to float32 for both runs here, as that is the one difference.)"""
    real_lr = optim.get_lr
    monkeypatch.setattr(optim, "get_lr", lambda step, cfg: torch.tensor(real_lr(step, cfg)).item())
    plain, graphed = tmp_path / "plain", tmp_path / "graphed"
    train.main(tiny_args(char_dataset, plain, max_iters=8))
    train.main(tiny_args(char_dataset, graphed, max_iters=8, cuda_graphs=True))
    assert train_losses(graphed) == train_losses(plain)
    assert_same_weights(weights(graphed), weights(plain))


def test_resume_of_a_graphed_run_is_exact(char_dataset, tmp_path, gpu_like):
    full, half = tmp_path / "full", tmp_path / "half"
    train.main(tiny_args(char_dataset, full, max_iters=8, cuda_graphs=True))
    train.main(tiny_args(char_dataset, half, max_iters=4, cuda_graphs=True))
    train.main(tiny_args(char_dataset, half, max_iters=8, cuda_graphs=True, init_from="resume"))
    assert train_losses(half) == train_losses(full)
    assert_same_weights(weights(half), weights(full))
    # and a graphed run's checkpoint resumes on the plain path (a float learning rate again)
    train.main(tiny_args(char_dataset, half, max_iters=10, init_from="resume", cuda_graphs=False))
    assert 10 in train_losses(half)


def test_a_non_finite_step_is_never_applied_nor_any_after_it(char_dataset, tmp_path, monkeypatch, gpu_like):
    """Step 4's NaN masks its update on the device, and every later one (the graph runs ahead of the host);
    the run stops with the one-line error and the checkpoints stay as they were."""
    out = tmp_path / "out"
    train.main(tiny_args(char_dataset, out, max_iters=3, cuda_graphs=True))
    before = {n: (out / n).read_bytes() for n in ("best.pt", "last.pt")}
    poison_training_forward(monkeypatch, 3)  # the 2nd micro-batch of the 2nd resumed step: step 4
    masked, unchanged = record_masked_steps(monkeypatch)
    with pytest.raises(SystemExit, match="non-finite loss or gradient norm at step 4"):
        train.main(tiny_args(char_dataset, out, max_iters=8, init_from="resume", eval_interval=100,
                             cuda_graphs=True))
    assert masked == [0.0, 1.0, 1.0]  # step 3 applied; step 4 masked, and step 5 after it, before the host knew
    assert unchanged == [False, True, True]
    assert {n: (out / n).read_bytes() for n in before} == before


SIGNAL_AT_GRAPHED_STEP = """
import os, signal, sys
from gptkit.cudagraph import GraphedStep
real = GraphedStep.__call__
calls = {"n": 0}
def call(self, *args, **kwargs):  # SIGTERM to ourselves in the middle of step 4
    calls["n"] += 1
    if calls["n"] == 5:
        os.kill(os.getpid(), signal.SIGTERM)
    return real(self, *args, **kwargs)
GraphedStep.__call__ = call
train.main(sys.argv[1:])
"""


def test_a_stop_signal_stops_at_a_step_boundary_and_resumes_exactly(char_dataset, tmp_path, gpu_like):
    """The stop flag goes into the graph through a device tensor, read a step late as on the plain GPU path: the
    run stops on a step boundary, saves, exits 143, and the resumed run equals an uninterrupted one."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    args = dict(max_iters=12, eval_interval=100, lr_decay_iters=12, cuda_graphs=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", GRAPHS_ON_CPU + SIGNAL_AT_GRAPHED_STEP,
                          *tiny_args(char_dataset, cut, **args)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 143, res.stdout + res.stderr
    from gptkit.checkpoint import load_checkpoint

    # The signal came as step 4 was handed in (its stop flag already 0): step 5 carries it, step 6's check reads
    # it, and the run stops after step 6, at 7, the same boundary on every rank.
    assert load_checkpoint(cut / "last.pt")["step"] == 7
    assert_resume_matches_uninterrupted(char_dataset, full, cut, **args)


def test_graph_step_outputs_and_learning_rate_tensor():
    """GraphedStep on its own: it reads the batches into its static buffers, returns the loss, the norm and the
    flags; set_lr fills the optimizer's learning-rate tensor in place (the object a graph reads)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = model

        def forward(self, x, y):
            return None, (self.lin(x.float()) - y.float()).pow(2).mean()

    class Loader:
        def next_batch(self):
            return torch.ones(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)

        def prefetch(self):
            pass

    from gptkit.config import TrainConfig

    cfg = TrainConfig(learning_rate=0.1, warmup_iters=0, decay_lr=False)
    opt = optim.make_adamw(list(model.parameters()), cfg, "cpu", graphable=True)
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and opt.defaults["fused"]
    optim.set_lr(opt, 0, cfg)
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.1)
    step = GraphedStep(Loss(), opt, torch.device("cpu"), accum=2, grad_clip=1.0,
                       autocast=Runtime(torch.device("cpu"), torch.float32).autocast)
    loss, norm, flags = step(Loader(), stop_requested=True)
    assert torch.equal(step.x, torch.ones(2, 2, 4, dtype=torch.long)) and loss > 0 and norm > 0
    assert flags.tolist() == [0.0, 1.0]
    assert all(p.grad is None for p in model.parameters())  # eager: freed after the step, as the plain loop


def test_a_float_learning_rate_in_a_checkpoint_keeps_the_graphs_tensor():
    """Loading optimizer state (a checkpoint of the plain path, lr a float) keeps the learning-rate tensor the
    graph was captured with, filled with the loaded value; and the plain optimizer gets its float back."""
    from gptkit.config import TrainConfig

    p = torch.nn.Parameter(torch.zeros(3))
    cfg = TrainConfig(learning_rate=0.5)
    graphable = optim.make_adamw([p], cfg, "cpu", graphable=True)
    plain = optim.make_adamw([p], cfg, "cpu")
    tensor = graphable.param_groups[0]["lr"]
    state = plain.state_dict()
    state["param_groups"][0]["lr"] = 0.25
    optim.load_optimizer_state(graphable, state)
    assert graphable.param_groups[0]["lr"] is tensor and float(tensor) == 0.25
    optim.load_optimizer_state(plain, graphable.state_dict())
    assert plain.param_groups[0]["lr"] == 0.25 and isinstance(plain.param_groups[0]["lr"], float)


def test_the_decision_says_why():
    cpu = Runtime(torch.device("cpu"), torch.float32)
    on, why = resolve_cuda_graphs(None, cpu, world_size=1, optimizer="adamw", compiled=False)
    assert not on and "--cuda_graphs=True" in why and "a CUDA device" in why
    assert resolve_cuda_graphs(False, cpu, world_size=1, optimizer="adamw", compiled=False)[0] is False
    with pytest.raises(DeviceError, match="needs a CUDA device, one process .*--optimizer=adamw"):
        resolve_cuda_graphs(True, cpu, world_size=2, optimizer="muon", compiled=False)
    cuda16 = Runtime(torch.device("cuda"), torch.float16)  # (nothing touches the device)
    with pytest.raises(DeviceError, match="bfloat16 or float32"):
        resolve_cuda_graphs(True, cuda16, world_size=1, optimizer="adamw", compiled=True)
    on, why = resolve_cuda_graphs(True, Runtime(torch.device("cuda"), torch.bfloat16), world_size=1,
                                  optimizer="adamw", compiled=True)
    assert on and "CUDA graphs on" in why


def test_the_guard_reuses_one_host_buffer(gpu_like):
    """Deferred, the guard copies every step's flags into the same host buffer (pinned on CUDA): nothing is
    allocated per step for them (a new pinned tensor and event a step made the GPU's step time creep up)."""
    rt = runtime.setup_runtime("cpu", "float32")
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=0.1, fused=True)
    guard = StepGuard(optimizer, rt, Dist())
    one = torch.tensor(1.0)
    seen = set()
    for step in range(50):
        guard.check(step, one * step, one, False)
        seen.add(guard.pending[1].data_ptr())
    assert seen == {guard.host.data_ptr()} and guard.settle().loss == 49.0


def test_the_host_work_per_step_does_not_grow(char_dataset, tmp_path, monkeypatch, gpu_like):
    """Nothing accumulates from step to step in a long tiny run (the host time per step then stays flat: a run
    that keeps objects per step slows down as it goes): the live Python objects after step 100 and after step
    400 are the same in number, on the plain path and on the graph path. (The step time itself, early and late,
    is gpu_check's steps part: a timing, not a test.)"""
    counts = {}
    real = train.Metrics.step_done

    def step_done(self):
        real(self)
        counts.setdefault(self.key, {})
        if self.done in (100, 400):
            gc.collect()
            counts[self.key][self.done] = len(gc.get_objects())
        self.done += 1

    monkeypatch.setattr(train.Metrics, "step_done", step_done)
    for graphs in (False, True):
        monkeypatch.setattr(train.Metrics, "key", graphs, raising=False)
        monkeypatch.setattr(train.Metrics, "done", 1, raising=False)
        train.main(tiny_args(char_dataset, tmp_path / str(graphs), max_iters=401, eval_interval=1000,
                             log_interval=50, lr_decay_iters=401, n_layer=1, n_embd=16, block_size=8,
                             gradient_accumulation_steps=1, eval_iters=1, cuda_graphs=graphs))
    for graphs, seen in counts.items():
        assert abs(seen[400] - seen[100]) <= 10, (graphs, seen)


def test_block_compilation_gives_the_losses_of_the_eager_model(char_dataset, tmp_path, monkeypatch):
    """compile_scope=blocks compiles each block on its own (the embeddings, head and loss stay eager): the
    same losses as without compilation, to float rounding, and the checkpoint's names are the plain model's.
    (The aot_eager backend: Dynamo's graphs of each block, forward and backward traced by AOTAutograd, without
    inductor's code generation, which tests/test_modern.py and tests/test_generate.py cover.)"""
    eager, blocks = tmp_path / "eager", tmp_path / "blocks"
    args = dict(max_iters=3, eval_interval=100, dropout=0.0)
    train.main(tiny_args(char_dataset, eager, **args))
    import torch._dynamo

    graphs, aot_eager = [], torch._dynamo.lookup_backend("aot_eager")

    def counted(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counted))
    train.main(tiny_args(char_dataset, blocks, compile=True, compile_scope="blocks", **args))
    torch._dynamo.reset()
    matrices = [{tuple(n.meta["example_value"].shape) for n in gm.graph.nodes
                 if n.op == "placeholder" and n.meta["example_value"].dim() == 2} for gm in graphs]
    assert graphs and all(m == {(96, 32), (32, 32), (128, 32), (32, 128)} for m in matrices), matrices  # a block's
    a, b = train_losses(eager), train_losses(blocks)
    assert a.keys() == b.keys()
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4)
    assert weights(blocks).keys() == weights(eager).keys()


def test_the_run_clock_starts_at_the_process_start(char_dataset, tmp_path):
    """metrics.jsonl's elapsed_s is read on the process' clock (imports, CUDA's start and setup count): even the
    first entry is later than the age this test process had before the run began."""
    age = runtime.process_elapsed()
    out = tmp_path / "out"
    train.main(tiny_args(char_dataset, out, max_iters=1))
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["elapsed_s"] >= age > 0


def test_settings_a_capture_cannot_record_are_refused_before_the_first_step(char_dataset, tmp_path):
    """--cuda_graphs=True with --activation_checkpointing=True (train.py) or with a compile mode that records its
    own CUDA graphs (bench.py): one line each, before anything is built or run; auto graphs stay quietly off."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=r"^error: --activation_checkpointing=True cannot run with "
                                         r"--cuda_graphs=True \(.*\); drop one of the two$"):
        train.main(tiny_args(char_dataset, out, cuda_graphs=True, activation_checkpointing=True))
    assert not out.exists()
    train.main(tiny_args(char_dataset, out, max_iters=1, activation_checkpointing=True))  # (auto: graphs off)
    import bench

    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(SystemExit, match=rf"^error: --compile_mode={mode} records CUDA graphs of its own, .*"
                                             rf"or --cuda_graphs=False$"):
            bench.main(["--device=cpu", "--models=tiny", "--skip_decode", "--compile=True",
                        f"--compile_mode=default,{mode}", "--cuda_graphs=False,True"])
    with pytest.raises(SystemExit, match="needs the model compiled"):  # (without graphs: bench's own check)
        bench.main(["--device=cpu", "--models=tiny", "--skip_decode", "--compile=False",
                    "--compile_mode=reduce-overhead"])



def test_a_save_asked_in_the_warm_up_is_written_before_the_capture_begins(char_dataset, tmp_path, monkeypatch,
                                                                          gpu_like):
    """--async_save: last.pt, saved at step 2's evaluation, is still being written in the background when the step
    whose capture begins comes (step 3, after the three warm-up steps): the capture waits for it, so that the
    writer thread never touches the device while a capture records. The writer is held until that moment (on
    the CPU: where GraphedStep would capture), then released: the write is complete when the capture begins."""
    import threading

    import gptkit.checkpoint.background as background

    release, written = threading.Event(), threading.Event()
    real_save, real_begins = background.save_checkpoint, GraphedStep.capture_begins

    def held_save(obj, path):
        if path.name == "last.pt" and not release.is_set():
            release.wait(timeout=60)  # (a limit, should the capture never begin: the run then goes on, and fails)
            real_save(obj, path)
            written.set()
        else:
            real_save(obj, path)

    seen = []

    def capture_begins(self):
        seen.append((self.steps, written.is_set()))  # the write is held: not done
        release.set()
        real_begins(self)
        seen.append((self.steps, written.is_set()))

    monkeypatch.setattr(background, "save_checkpoint", held_save)
    monkeypatch.setattr(GraphedStep, "capture_begins", capture_begins)
    out = tmp_path / "out"
    train.main(tiny_args(char_dataset, out, max_iters=5, eval_interval=2, lr_decay_iters=5, async_save=True,
                         cuda_graphs=True))
    assert seen == [(3, False), (3, True)]
    from gptkit.checkpoint import load_checkpoint

    assert load_checkpoint(out / "last.pt")["step"] == 5


def test_a_recompile_inside_the_capture_names_its_guard(monkeypatch):
    """A compiled model that would compile again inside the capture fails there with the guard that changed
    (torch._dynamo's error_on_recompile, on for the capture only), not with an error from inside the CUDA
    capture. On the CPU torch.cuda's graph is a stand-in, inside which the step runs as it would be recorded."""
    import contextlib

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.scale = torch.nn.Linear(4, 4), 1.0

        def forward(self, x, y):
            return None, ((self.lin(x.float()) * self.scale - y.float()) ** 2).mean()

    class Loader:
        def next_batch(self):
            return torch.ones(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)

        def prefetch(self):
            pass

    class Graph:
        def replay(self):
            pass

    recorded = []

    @contextlib.contextmanager
    def graph(cuda_graph, **kwargs):
        recorded.append(torch._dynamo.config.error_on_recompile)
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    from gptkit.config import TrainConfig

    model = Model()
    opt = optim.make_adamw(list(model.parameters()), TrainConfig(learning_rate=0.1), "cpu", graphable=True)
    torch._dynamo.reset()
    step = GraphedStep(torch.compile(model, backend="eager"), opt, torch.device("cpu"), accum=1, grad_clip=1.0,
                       autocast=Runtime(torch.device("cpu"), torch.float32).autocast)
    step(Loader(), False)  # compiled here, as in a warm-up step
    step._capture()  # the same guards: recorded once, no recompile
    model.scale = 2.0  # a guard of the compiled forward no longer holds
    with pytest.raises(torch._dynamo.exc.RecompileError, match=r"self\.scale == 1\.0"):
        step._capture()
    assert recorded == [True, True] and torch._dynamo.config.error_on_recompile is False
    torch._dynamo.reset()
