"""sample.py: cached vs uncached decoding, stop tokens, streaming, the CLI end to end, and its one-line errors."""

import dataclasses
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sample
from gptkit.checkpoint import save_checkpoint
from gptkit.generate import SamplingOptions, TextStream, compile_decode_step, decode_step
from gptkit.tokenizer import Tokenizer
from model import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]
CHARS = sorted(set("\n !',.:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"))
HEADER = "---------- sample {}/{} ----------"


def make_checkpoint(folder: Path, tokenizer_meta: dict, vocab_size: int, block_size: int = 32, seed: int = 0,
                    edit=None) -> Path:
    """A random tiny model saved the way train.py saves one (dropout on, to check sampling turns it off)."""
    cfg = GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    torch.manual_seed(seed)
    model = GPT(cfg)
    if edit is not None:
        edit(model)
    meta = {"format_version": 1, "tokenizer": tokenizer_meta, "vocab_size": vocab_size,
            "eot_id": tokenizer_meta.get("eot_id"), "splits": {}}
    state = {"format": 1, "model_config": cfg.to_dict(), "model": model.state_dict(), "tokenizer": meta,
             "step": 7, "config": {}}
    save_checkpoint(state, folder / "best.pt")
    return folder


@pytest.fixture
def char_ckpt(tmp_path):
    return make_checkpoint(tmp_path / "out", {"kind": "char", "chars": CHARS}, len(CHARS))


@pytest.fixture
def gpt2_tokenizer():
    try:
        return Tokenizer.tiktoken("gpt2")
    except Exception as e:  # the BPE files are not cached on this machine
        pytest.skip(f"tiktoken gpt2 unavailable: {e}")


def run_cli(capsys, *args) -> str:
    sample.main(["--device=cpu", *args])
    return capsys.readouterr().out


def split_samples(out: str, n: int) -> list[str]:
    """The texts between the separator lines (each sample is followed by one newline)."""
    texts, rest = [], out
    for i in range(n):
        head = HEADER.format(i + 1, n) + "\n"
        assert rest.startswith(head), rest[:80]
        rest = rest[len(head):]
        nxt = rest.find(HEADER.format(i + 2, n)) if i + 1 < n else len(rest)
        texts.append(rest[:nxt])
        rest = rest[nxt:]
    return [t[:-1] if t.endswith("\n") else t for t in texts]


# ----------------------------------------------------------------------------- decoding


def test_cache_and_no_cache_agree_greedy_past_block_size(tiny_model, tiny_config):
    prompt = [3, 1, 4, 1, 5]
    n = 2 * tiny_config.block_size + 7  # slides the window (and rebuilds the cache) twice
    greedy = SamplingOptions(temperature=0.0)
    cached = sample.generate_ids(tiny_model, prompt, 3, n, greedy)
    uncached = sample.generate_ids(tiny_model, prompt, 3, n, greedy, use_cache=False)
    assert cached == uncached
    assert len(cached) == 3 and all(len(row) == n for row in cached)


def test_cache_and_no_cache_agree_with_a_seed(tiny_model, tiny_config):
    n = tiny_config.block_size + 20

    def draw(use_cache):
        g = torch.Generator().manual_seed(123)
        options = SamplingOptions(temperature=1.0, top_k=20, top_p=0.9)
        return sample.generate_ids(tiny_model, [7], 4, n, options, generator=g, use_cache=use_cache)

    cached = draw(True)
    assert cached == draw(False)
    assert len({tuple(row) for row in cached}) > 1  # a batch of samples, not one sample four times


def test_stop_token_ends_each_sample(tiny_model):
    def draw(stop):
        g = torch.Generator().manual_seed(5)
        return sample.generate_ids(tiny_model, [1, 2], 4, 40, SamplingOptions(stop_token=stop), generator=g)

    free = draw(None)
    stop = free[0][6]  # a token the first sample draws at its 7th step
    stopped = draw(stop)
    for row, free_row in zip(stopped, free):
        assert stop not in row
        expected = free_row[: free_row.index(stop)] if stop in free_row else free_row
        assert row == expected  # the same draws, cut just before the stop token
    assert len(stopped[0]) <= 6


def test_text_stream_holds_back_split_utf8_characters(gpt2_tokenizer):
    text = "héllo 😀 世界 ☃ naïve ok"
    ids = gpt2_tokenizer.encode(text)
    stream = TextStream(gpt2_tokenizer)
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert "" in pieces[:-1]  # some token ended mid-character and was held back
    assert not any("\ufffd" in p for p in pieces)


def test_text_stream_flushes_invalid_bytes(gpt2_tokenizer):
    lone_continuation_byte = 222  # b"\x80" on its own: never a complete character
    stream = TextStream(gpt2_tokenizer)
    assert stream.push(lone_continuation_byte) == ""
    assert stream.flush() == gpt2_tokenizer.decode([lone_continuation_byte]) == "\ufffd"


def test_compiled_step_never_recompiles(tiny_model, tiny_config):
    """generate_stream feeds the one-token step inputs of fixed shape and strides (the token, the position, the
    noise), so a compiled step is traced once per batch size and options, sampling included. (The eager
    backend traces like the real one, without the slow code generation; the CUDA graph path needs a GPU.)"""
    import torch._dynamo

    n = tiny_config.block_size + 10  # past block_size: refills of the window between the compiled steps
    for batch, options in ((2, SamplingOptions(temperature=0.0)), (1, SamplingOptions(temperature=0.8, top_k=9))):
        torch._dynamo.reset()

        def ids(batch=batch, options=options, **kwargs):
            return sample.generate_ids(tiny_model, [1, 2, 3], batch, n, options,
                                       generator=torch.Generator().manual_seed(0), **kwargs)

        reference = ids()
        compiled = torch.compile(decode_step, backend="eager", fullgraph=True, dynamic=False)
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = ids(step_fn=compiled)
        assert got == reference
    torch._dynamo.reset()


def test_compile_auto_is_off_on_the_cpu_and_stderr_says_when_it_compiles(capsys, char_ckpt, monkeypatch):
    """Compiled, sample.py decodes in windows of DECODE_WINDOW tokens: the same text as the eager decode."""
    import torch._dynamo

    import gptkit.generate as generate_module

    args = ["--device=cpu", f"--ckpt={char_ckpt}", "--max_new_tokens=5"]
    sample.main(args)
    eager = capsys.readouterr()
    assert "decode step not compiled: not by default on cpu" in eager.err
    compiled, windows = [], []

    def fake_compile(device):  # the real one is tested in test_generate.py; here only the CLI's wiring
        compiled.append(device)
        return compile_decode_step(device, compiler=lambda fn: torch.compile(fn, backend="eager", fullgraph=True,
                                                                             dynamic=False))

    real_window = generate_module.decode_window
    monkeypatch.setattr(sample, "compile_decode_step", fake_compile)
    monkeypatch.setattr(generate_module, "decode_window", lambda *a, **k: windows.append(a[3]) or real_window(*a, **k))
    torch._dynamo.reset()
    sample.main([*args, "--compile=True"])
    torch._dynamo.reset()
    got = capsys.readouterr()
    assert "compiling the decode step" in got.err and compiled == [torch.device("cpu")] and got.out == eager.out
    assert windows == [sample.DECODE_WINDOW]  # one window holds the 4 tokens after the prompt's


def test_cut_at():
    assert sample.cut_at([1, 2, 3, 2], 2) == [1]
    assert sample.cut_at([1, 2, 3], None) == [1, 2, 3]
    assert sample.cut_at([1, 3], 2) == [1, 3]


# ----------------------------------------------------------------------------- the CLI


def test_cli_two_samples_are_one_batch_and_separated(capsys, char_ckpt):
    out = run_cli(capsys, f"--ckpt={char_ckpt}", "--num_samples=2", "--max_new_tokens=25", "--stream=False")
    texts = split_samples(out, 2)
    assert all(len(t) == 25 and set(t) <= set(CHARS) for t in texts)
    assert texts[0] != texts[1]
    # Same seed, same samples (and dropout, on in the saved config, is off while sampling).
    assert run_cli(capsys, f"--ckpt={char_ckpt}", "--num_samples=2", "--max_new_tokens=25") == out


def test_cli_with_prompt_and_checkpoint_file(capsys, char_ckpt):
    out = run_cli(capsys, "--ckpt", str(char_ckpt / "best.pt"), "--prompt", "ROMEO:", "--max_new_tokens=15",
                  "--temperature=0")
    assert out.startswith("ROMEO:") and out.endswith("\n") and len(out) == len("ROMEO:") + 15 + 1
    assert HEADER.format(1, 1) not in out


def test_cli_prompt_file_and_prompt_longer_than_block_size(capsys, char_ckpt, tmp_path):
    long_prompt = "To be, or not to be, that is the question:\n" * 3  # 129 characters, block_size 32
    path = tmp_path / "prompt.txt"
    path.write_text(long_prompt, encoding="utf-8")
    out = run_cli(capsys, f"--ckpt={char_ckpt}", f"--prompt_file={path}", "--max_new_tokens=10")
    assert out.startswith(long_prompt) and len(out) == len(long_prompt) + 10 + 1


@pytest.mark.parametrize("n", [1, 3])
def test_streamed_output_equals_final_text(capsys, char_ckpt, n):
    common = [f"--ckpt={char_ckpt}", f"--num_samples={n}", "--max_new_tokens=30", "--prompt=Hi"]
    streamed = run_cli(capsys, *common, "--stream")
    assert streamed == run_cli(capsys, *common, "--stream=False")


def test_a_streamed_window_ends_at_the_stop_token():
    """Tokens come a window at a time when the decode is compiled: those after the stop token are computed but
    never shown, so the streamed text ends at the same character as the final text."""
    tokenizer = Tokenizer.char_from_text("abcdef")
    stop = tokenizer.encode("f")[0]
    out = io.StringIO()
    printer = sample.Printer(out, tokenizer, "P:", 1, stop)
    on_block = printer.stream_first()
    ids = tokenizer.encode("abc") + [stop] + tokenizer.encode("de")
    for block in (ids[:2], ids[2:], tokenizer.encode("e")):  # a window holding the stop, one after it
        on_block(torch.tensor([block, block]))  # (2 samples: only the first is streamed)
    text = "P:" + tokenizer.decode(sample.cut_at(ids, stop))
    printer.finish([text])
    assert out.getvalue() == text + "\n" == "P:abc\n"


def test_streams_by_default_on_a_terminal(char_ckpt):
    class Terminal(io.StringIO):
        def __init__(self):
            super().__init__()
            self.writes = []

        def isatty(self):
            return True

        def write(self, s):
            self.writes.append(s)
            return super().write(s)

    cfg = sample.SampleConfig(ckpt=str(char_ckpt), prompt="Hi", max_new_tokens=30, device="cpu")
    out = Terminal()
    texts = sample.run(cfg, out=out, err=io.StringIO())
    assert out.getvalue() == texts[0] + "\n"
    assert len([w for w in out.writes if w]) >= 30  # the prompt, then every token as it came

    out = Terminal()
    sample.run(dataclasses.replace(cfg, num_samples=2), out=out, err=io.StringIO())
    assert len(out.writes) == 4  # several samples: not streamed unless asked for


def test_streaming_a_bpe_model_cut_at_end_of_text(capsys, tmp_path, gpt2_tokenizer):
    """A BPE model whose every prediction is end-of-text: the sample is the prompt alone."""
    eot = gpt2_tokenizer.eot_id

    def always_eot(model):
        with torch.no_grad():
            # ln_f then outputs its bias whatever the input, and the (tied) head scores eot far above the rest.
            model.transformer.ln_f.weight.zero_()
            model.transformer.ln_f.bias.normal_()
            model.transformer.wte.weight[eot] = 50 * model.transformer.ln_f.bias

    ckpt = make_checkpoint(tmp_path / "bpe", {"kind": "tiktoken", "name": "gpt2"}, gpt2_tokenizer.vocab_size,
                           edit=always_eot)
    for stream in ("--stream", "--stream=False"):
        out = run_cli(capsys, f"--ckpt={ckpt}", "--prompt=Hello, wörld", "--temperature=1", stream)
        assert out == "Hello, wörld\n"
    out = run_cli(capsys, f"--ckpt={ckpt}", "--num_samples=2")  # empty prompt: starts from end-of-text
    assert split_samples(out, 2) == ["", ""]


def test_init_from_a_local_hf_folder_of_a_char_model(capsys, char_ckpt, tmp_path):
    """export.py's Hugging Face folder of a char model keeps its vocabulary in char_vocab.json: sampling it
    with --init_from gives what sampling the checkpoint gives."""
    from export import export_hf
    from gptkit.checkpoint import load_checkpoint, model_from_checkpoint

    ckpt = load_checkpoint(char_ckpt)
    export_hf(model_from_checkpoint(ckpt), tmp_path / "hf", ckpt["tokenizer"])
    args = ["--prompt=ROMEO:", "--max_new_tokens=20", "--num_samples=2"]
    assert run_cli(capsys, f"--init_from={tmp_path / 'hf'}", *args) == run_cli(capsys, f"--ckpt={char_ckpt}", *args)


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        sample.main(["--help"])
    assert e.value.code == 0
    assert "--max_new_tokens" in capsys.readouterr().out


# ----------------------------------------------------------------------------- one-line errors


def expect_error(capsys, args, *fragments):
    with pytest.raises(SystemExit) as e:
        sample.main(["--device=cpu", *args])
    message = e.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err


def test_unknown_prompt_character_is_named(capsys, char_ckpt):
    expect_error(capsys, [f"--ckpt={char_ckpt}", "--prompt=naïve"], "'ï'")


def test_checkpoint_errors(capsys, tmp_path):
    expect_error(capsys, [f"--ckpt={tmp_path / 'nowhere'}"], "does not exist", "train.py")
    (tmp_path / "empty").mkdir()
    expect_error(capsys, [f"--ckpt={tmp_path / 'empty'}"], "no checkpoint", "train.py")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    expect_error(capsys, [f"--ckpt={tmp_path / 'junk.pt'}"], "junk.pt")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--ckpt=out", "--init_from=gpt2"], "not both"),
        (["--prompt=a", "--prompt_file=p.txt"], "not both"),
        (["--prompt_file=/no/such/prompt.txt"], "does not exist"),
        (["--init_from=scratch"], "--ckpt"),  # (resume is nanoGPT's: the checkpoint in --out_dir)
        (["--init_from=/no/such/gpt2-folder"], "/no/such/gpt2-folder"),
        (["--temperature=-0.5"], "temperature"),
        (["--top_p=0"], "top_p"),
        (["--top_p=1.5"], "top_p"),
        (["--top_k=-1"], "top_k"),
        (["--num_samples=0"], "num_samples"),
        (["--max_new_tokens=0"], "max_new_tokens"),
        (["--num_samples=two"], "num_samples"),
        (["--seed=-1"], "seed"),
        ([f"--seed={2**63}"], "seed"),
        (["--dtype=float8"], "dtype"),
        (["--device=toaster"], "toaster"),
        (["--temperatur=1"], "temperature"),  # unknown key: suggests the right one
        (["positional"], "positional"),
    ],
)
def test_bad_options(capsys, char_ckpt, args, fragment):
    chooses_model = any(a.startswith(("--ckpt", "--init_from")) for a in args)
    expect_error(capsys, args if chooses_model else [f"--ckpt={char_ckpt}", *args], fragment)


def test_error_from_a_real_process_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, "sample.py", f"--ckpt={tmp_path / 'missing'}"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr


# ----------------------------------------------------------------------------- benchmark helper
