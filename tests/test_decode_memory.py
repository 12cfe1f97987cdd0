"""How long a decode may be: a max_new_tokens whose token buffers cannot fit in memory is one line saying what
fits, before anything is allocated (gptkit/generate.py's check_decode_memory, sample.py, generate and
model.generate); chat.py and the serving engine size nothing from it (a reply ends where the context does)."""

import io
import re
import sys

import pytest
import torch

import chat
import sample
from gptkit import generate as gen
from gptkit.checkpoint import save_checkpoint
from gptkit.errors import UserError
from gptkit.generate import DecodeTooLong, check_decode_memory, generate, generate_stream
from gptkit.tokenizer import CHAT_SPECIALS, Tokenizer
from model import GPT, GPTConfig

CHARS = sorted(set("\n !',.?abcdefghijklmnopqrstuvwxyz"))
GiB = 2**30


def save_model(folder, tokenizer: Tokenizer, block_size: int = 32):
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=block_size, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=2, n_embd=16)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"tokenizer": tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
            "splits": {}}
    save_checkpoint({"format": 1, "model_config": cfg.to_dict(), "model": GPT(cfg).state_dict(), "tokenizer": meta,
                     "step": 1, "config": {}}, folder / "best.pt")
    return folder


@pytest.fixture
def char_ckpt(tmp_path):
    return save_model(tmp_path / "out", Tokenizer({"kind": "char", "chars": CHARS}))


def one_line_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        sample.main(["--device=cpu", "--threads=1", *argv])
    message = e.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    assert "Traceback" not in capsys.readouterr().err
    return message


@pytest.mark.parametrize("argv, batch", [(["--max_new_tokens=1000000000000"], 1),
                                         (["--max_new_tokens=100000000", "--num_samples=1000"], 1000)])
def test_sample_py_says_what_fits_before_loading_the_model(capsys, char_ckpt, monkeypatch, argv, batch):
    # The commands of the report, on this machine's real free memory (no machine holds their ~9-90 TiB)...
    monkeypatch.setattr(sample, "load_model", lambda cfg: pytest.fail("the model was loaded before the check"))
    message = one_line_error(capsys, [f"--ckpt={char_ckpt}", *argv])
    assert re.search(r"needs ~[\d,.]+ TiB of RAM .* at most --max_new_tokens=\d+ fits with --num_samples=" + str(batch),
                     message), message
    # ...and on a machine with 8 GiB free: the figure is half of it over 96 bytes a token (16 in the device's
    # two buffers, 80 in the text), less the prompt (the empty prompt is one token)
    monkeypatch.setattr(gen, "_free_memory", lambda device: 8 * GiB)
    message = one_line_error(capsys, [f"--ckpt={char_ckpt}", *argv])
    fits = int(re.search(r"at most --max_new_tokens=(\d+) fits", message).group(1))
    assert fits == 4 * GiB // (batch * 96) - 1
    sample.check_length(batch, 1, fits, torch.device("cpu"))
    with pytest.raises(DecodeTooLong):
        sample.check_length(batch, 1, fits + 1, torch.device("cpu"))


def test_the_length_it_names_runs_and_one_more_is_refused(capsys, char_ckpt, monkeypatch):
    monkeypatch.setattr(gen, "UNCHECKED_BYTES", 0)  # check even tiny buffers
    monkeypatch.setattr(gen, "_free_memory", lambda device: 2 * 96 * 2 * (1 + 40))  # 40 tokens for 2 samples
    message = one_line_error(capsys, [f"--ckpt={char_ckpt}", "--num_samples=2", "--max_new_tokens=41"])
    assert message.endswith("at most --max_new_tokens=40 fits with --num_samples=2"), message
    sample.main(["--device=cpu", "--threads=1", f"--ckpt={char_ckpt}", "--num_samples=2", "--max_new_tokens=40"])
    texts = capsys.readouterr().out.split("---------- sample 2/2 ----------\n")
    assert len(texts) == 2 and len(texts[1]) == 40 + 1  # 40 characters and the newline after the sample


def test_generate_refuses_before_allocating(tiny_model, tiny_config):
    idx = torch.zeros(2, 3, dtype=torch.long)
    # 10**13 tokens: had the buffer been asked for, the allocator would have raised a RuntimeError
    with pytest.raises(DecodeTooLong, match=r"^max_new_tokens=10000000000000 for 2 sequences needs ~") as e:
        generate(tiny_model, idx, 10**13)
    assert isinstance(e.value, ValueError) and isinstance(e.value, UserError)  # a bad argument; one line in a script
    with pytest.raises(DecodeTooLong, match="at most max_new_tokens="):
        tiny_model.generate(idx, 10**13)  # nanoGPT's call
    with pytest.raises(DecodeTooLong):
        next(generate_stream(tiny_model, idx, 10**13))
    out = generate(tiny_model, idx, 5)  # an ordinary length is untouched
    assert out.shape == (2, 8) and torch.equal(out[:, :3], idx)


def test_on_a_gpu_the_device_and_the_ram_are_checked_apart(monkeypatch):
    free = {"cuda": 1 * GiB, "cpu": 100 * GiB}
    monkeypatch.setattr(gen, "_free_memory", lambda device: free[device.type])
    n = 10**8  # 1.6 GB on the GPU (16 bytes a token), 8 GB of text in RAM (80)
    with pytest.raises(DecodeTooLong, match=r"of cuda memory for its tokens \(16 bytes each\).* at most "
                                            r"--max_new_tokens=33554431 fits"):
        check_decode_memory(1, 1, n, "cuda", device_bytes=16, host_bytes=80, option="--max_new_tokens")
    free.update(cuda=100 * GiB, cpu=4 * GiB)
    with pytest.raises(DecodeTooLong, match=r"of RAM for its tokens \(80 bytes each\)"):
        check_decode_memory(1, 1, n, "cuda", device_bytes=16, host_bytes=80)
    free.update(cpu=100 * GiB)
    check_decode_memory(1, 1, n, "cuda", device_bytes=16, host_bytes=80)  # both fit
    with pytest.raises(DecodeTooLong, match=r"not one token fits with --num_samples=64: free some memory or lower "
                                            r"--num_samples"):
        free.update(cpu=1 * GiB)
        check_decode_memory(64, 2**23, 1, "cpu", host_bytes=80, option="--max_new_tokens",
                            batch_option="--num_samples")


def test_chat_py_sizes_nothing_from_max_new_tokens(tmp_path, monkeypatch, capsys):
    # chat.py (and serve.py) decode with the serving engine, whose buffers follow the context and the batch:
    # a reply ends when the context is full, however large --max_new_tokens is.
    chars = Tokenizer({"kind": "char", "chars": CHARS}).with_special(CHAT_SPECIALS)
    folder = save_model(tmp_path / "chat", chars, block_size=24)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    chat.main([f"--ckpt={folder}", "--device=cpu", "--threads=1", "--temperature=0", "--max_new_tokens=1000000000000"])
    reply = capsys.readouterr().out.split("\n\n")[0]
    prompt = 1 + 1 + len("hi") + 1 + 1  # <|endoftext|><|user|>hi<|end|><|assistant|>
    assert len(chars.encode(reply)) <= 24 - prompt + 1  # the last one drawn from the context's last position
