"""Shared test fixtures: a tiny GPT, the offline tiktoken cache and the shared Shakespeare text."""

import contextlib
import functools
import importlib.util
import os
import sys
from pathlib import Path

import pytest

# the `cuda` marker, and under CI a skip of any other test is a failure (tests/ci_skips.py); pytester runs
# small pytest sessions for the test of that rule
pytest_plugins = ["ci_skips", "pytester"]

# One torch thread in each test process, and in what it starts, unless a test says otherwise. `pytest -n auto`
# runs a process per core, and torch's default of a thread per core in each would put two threads on every core
# (GNU OpenMP's team then waits for descheduled threads: the slowdown train.py's auto thread count avoids). And
# a run's arithmetic follows its thread count, which auto would choose from the machine's load at each start:
# tests comparing two runs bit for bit must not depend on that. (Set before torch starts, which reads it then;
# tests of the auto choice unset it.)
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # (a plugin started it before this file: it read no OMP_NUM_THREADS)
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

REPO = Path(__file__).resolve().parents[1]
# ../shared/data beside the checkout in this workplace (no network), or a copy of it inside the checkout
# (shared/data: what travels to a machine with a GPU, where ../shared does not; .gitignore keeps it out of git)
SHARED_DATA = next((p for p in (REPO.parent / "shared" / "data", REPO / "shared" / "data") if p.is_dir()),
                   REPO.parent / "shared" / "data")

# The real GPT-2 BPE files live there; tiktoken reads them from there.
if (SHARED_DATA / "tiktoken_cache").is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED_DATA / "tiktoken_cache"))


@functools.cache
def gpt2_bpe_problem() -> str | None:
    """Why tiktoken's GPT-2 BPE files cannot be had here (downloaded on first use, or TIKTOKEN_CACHE_DIR), or
    None when they can. (Asked when a test needs them, not when this file is imported: loading them costs a
    third of a second in every process that imports it, torchrun's workers here included.)"""
    try:
        import tiktoken

        tiktoken.get_encoding("gpt2")
    except Exception as e:  # no network and no cache: a requests/OS error
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return None


# Tests that tokenize with the GPT-2 BPE skip, saying why, where its files cannot be downloaded or found.
needs_gpt2_bpe = pytest.mark.gpt2_bpe


def pytest_configure(config):
    config.addinivalue_line("markers", "gpt2_bpe: the test tokenizes with the GPT-2 BPE (skipped without its files)")
    # Inductor's CPU backend takes the vector instructions /proc/cpuinfo lists as they are, instead of proving
    # each by compiling and loading a probe library: ~12 s of g++ in the first compile on a machine without
    # inductor's cache (CI's), and a Python child per instruction set in every process after that. What the
    # compile tests check (our code traced and generated, and its values) does not depend on the probe. Set
    # before torch._inductor.config is imported (it reads the variable then); subprocesses inherit it.
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpt2_bpe") and gpt2_bpe_problem() is not None:
        pytest.skip(f"the GPT-2 BPE files are not available: {gpt2_bpe_problem()}")


# The slowest tests (seconds each on 2 quiet cores, from `--durations`), run first under `pytest -n`. xdist's
# worksteal hands each worker a contiguous share of the collection and lets an idle worker take the end of a
# busy one's queue: a slow test near the end of a share makes one worker run on alone at the end of the suite.
# pytest_collection_modifyitems puts these at the front of the shares, balanced across them (the greediest first
# onto the share with the least), so the shares end with quick tests the workers can trade. A group stays
# together (tests sharing a module-scoped fixture, made once). tests/test_ci_skips.py checks each name exists.
SLOWEST = [
    (28.0, "test_gpu_check.py::test_smoke_runs_every_part_or_says_why_not",
     "test_gpu_check.py::test_nanogpt_runs_beside_ours_in_smoke"),
    (22.0, "test_fsdp.py::test_fsdp_trains_as_one_process_does"),
    (17.0, "test_fsdp.py::test_a_sharded_checkpoint_survives_a_kill_and_resumes_under_fsdp_ddp_and_one_process"),
    (15.5, "test_restart.py::test_torchrun_restarts_a_killed_ddp_run_from_its_last_checkpoint"),
    (13.5, "test_restart.py::test_torchrun_restarts_a_killed_fsdp_run"),
    (9.5, "test_restart.py::test_two_nodes_as_the_readme_starts_them_train_as_one_process"),
    (8.5, "test_dpo_train.py::test_dpo_learns_its_pairs_and_chat_answers_by_the_rule"),
    (7.0, "test_fsdp.py::test_a_sharded_model_scores_hellaswag_and_each_process_holds_a_shard"),
    (6.5, "test_lm_eval.py::test_lm_eval_loglikelihoods_equal_evals"),
    (6.0, "test_reproduce.py::test_a_quick_rehearsal_prints_quoted_against_measured_and_skips_what_is_missing"),
    (6.0, "test_train_threads.py::test_a_tiny_rehearsal_gives_a_figure_per_setting_and_the_threads_each_ran_with"),
    (6.0, "test_step_profile.py::test_profile_fp8_loss_chunks_and_batches_together_with_an_oom_reported"),
    (5.5, "test_eval.py::test_bits_per_byte_of_a_char_model_is_its_loss_over_ln2"),
    (5.5, "test_cudagraph.py::test_the_host_work_per_step_does_not_grow"),
    (5.5, "test_async_save.py::test_sigterm_with_async_save_waits_for_the_write_and_resumes_exactly"),
    (5.0, "test_gpu_check.py::test_a_test_past_its_limit_is_stopped_and_pytest_goes_on_with_the_rest"),
    (4.5, "test_train.py::test_wandb_offline_logging"),
]


def pytest_collection_modifyitems(config, items):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # (set in each xdist worker)
    if workers < 2:
        return
    by_name = {item.nodeid.removeprefix("tests/"): item for item in items}
    groups = [(seconds, [by_name[n] for n in names if n in by_name]) for seconds, *names in SLOWEST]
    shares, loads = [[] for _ in range(workers)], [0.0] * workers
    for seconds, group in sorted(groups, key=lambda g: -g[0]):
        least = loads.index(min(loads))
        shares[least] += group
        loads[least] += seconds if group else 0.0
    moved = {id(item) for share in shares for item in share}
    rest = iter([item for item in items if id(item) not in moved])
    left = len(items)
    for i, share in enumerate(shares):  # each share as long as xdist's split of the collection will make it
        size = left // (workers - i)
        left -= size
        share += [next(rest) for _ in range(max(0, size - len(share)))]
    items[:] = [item for share in shares for item in share] + list(rest)


def train_script():
    """train.py, the script, loaded from its path once per process (kept as sys.modules["train_script"]: this
    file is imported as conftest and as tests.conftest, both get the one module). Tests import the package
    (gptkit.run, gptkit.objectives, ...) and use the script only to run it end to end, train_script().main(argv);
    what its loop calls (evaluate, save, setup_run, ...) can be monkeypatched on the module this returns. A
    test's subprocess loads it the same way: sys.path.insert(0, "tests"); from conftest import train_script."""
    module = sys.modules.get("train_script")
    if module is None:
        spec = importlib.util.spec_from_file_location("train_script", REPO / "train.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["train_script"] = module
    return module


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's thread count set to n inside the block, the count before it back afterwards. Tests of tiny models
    use one: on tiny matmuls a second thread only adds synchronisation (2-8x slower on a busy machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def shakespeare_path():
    """The 1.1M-character tiny Shakespeare corpus, where this machine has it."""
    path = SHARED_DATA / "tinyshakespeare.txt"
    if not path.is_file():
        pytest.skip("../shared/data/tinyshakespeare.txt is not present")
    return path


@pytest.fixture
def tiny_config():
    """A GPT small enough that a forward pass takes milliseconds on one CPU core."""
    from model import GPTConfig

    return GPTConfig(block_size=32, vocab_size=67, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)


@pytest.fixture
def tiny_model(tiny_config):
    import torch

    from model import GPT

    torch.manual_seed(0)
    return GPT(tiny_config).eval()


def tiny_args(data, out, **over) -> list[str]:
    """train.py's arguments for a tiny CPU run on `data` into `out` (2x32 model, 8 steps, evaluations at 3 and 6,
    dropout 0.1, one thread); `over` changes or adds settings. Test files derive their own runs from this one.
    One thread, not auto: the arithmetic (and so a bit-exact comparison of two runs) follows the thread count,
    which auto would choose from the machine's load at each start."""
    args = dict(dataset=str(data), out_dir=str(out), n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4,
                gradient_accumulation_steps=2, max_iters=8, eval_interval=3, eval_iters=3, log_interval=1,
                warmup_iters=2, lr_decay_iters=8, learning_rate=3e-3, min_lr=3e-4, dropout=0.1, device="cpu",
                compile=False, threads=1)
    args.update(over)
    return [f"--{k}={v}" for k, v in args.items()]


def write_dataset(path: Path, text: str, tokenizer) -> Path:
    """A prepared dataset folder from `text`: meta.json plus one train shard (first 90%) and one val shard."""
    import numpy as np

    from gptkit.data.shards import make_meta, shard_name, write_meta, write_shard

    ids = np.array(tokenizer.encode(text), dtype=np.int64)
    cut = int(0.9 * len(ids))
    path.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, part in (("train", ids[:cut]), ("val", ids[cut:])):
        write_shard(path / shard_name(split, 0), part, tokenizer.vocab_size)
        splits[split] = {"shards": [shard_name(split, 0)], "tokens": int(len(part))}
    write_meta(path, make_meta(tokenizer, splits, source="tests"))
    return path


def make_char_dataset(path: Path, n_chars: int = 60_000, seed: int = 0) -> Path:
    """A small character-level dataset made of random sentences over a small word list: learnable structure,
    so a few training steps lower the loss."""
    import numpy as np

    from gptkit.tokenizer import Tokenizer

    rng = np.random.default_rng(seed)
    words = ["the", "king", "queen", "shall", "speak", "to", "my", "lord", "and", "thou", "art", "good", "sir"]
    parts, size = [], 0
    while size < n_chars:
        sentence = " ".join(rng.choice(words, size=int(rng.integers(3, 9)))) + ".\n"
        parts.append(sentence)
        size += len(sentence)
    text = "".join(parts)
    return write_dataset(path, text, Tokenizer.char_from_text(text))


@pytest.fixture(scope="session")
def session_char_dataset(tmp_path_factory) -> Path:
    """make_char_dataset's dataset, made once per test process (each xdist worker has its own session): never
    handed to a test itself, only copied (char_dataset)."""
    return make_char_dataset(tmp_path_factory.mktemp("session_char_dataset") / "tiny_char")


@pytest.fixture
def char_dataset(tmp_path, session_char_dataset):
    """make_char_dataset's dataset in this test's tmp_path/data/tiny_char: a copy of the session's (milliseconds,
    where making it takes a quarter of a second), so that a test may change or add files in it."""
    import shutil

    return Path(shutil.copytree(session_char_dataset, tmp_path / "data" / "tiny_char"))


def counting_sequences(batch: int, length: int, vocab: int, device):
    """Rows that count up in steps of 3 (mod vocab) from random starts: a rule a tiny model learns fast."""
    import torch

    start = torch.randint(0, vocab, (batch, 1), device=device)
    return (start + 3 * torch.arange(length, device=device)) % vocab


def confident_model(cfg, device, steps: int = 100):
    """A model trained until it predicts counting_sequences with logit margins of several units (~5 after 100
    steps, measured on the CPU), far above any difference in rounding between two kernels (or batch sizes)."""
    import torch

    from model import GPT

    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with torch_threads(1):
        for _ in range(steps):
            seq = counting_sequences(32, cfg.block_size + 1, cfg.vocab_size, device)
            loss = model(seq[:, :-1], seq[:, 1:])[1]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return model.eval()
