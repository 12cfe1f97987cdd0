"""GGUF export (gptkit/gguf.py, export.py --format gguf), checked against llama.cpp itself through
llama-cpp-python: its logits, its greedy decode and its tokenizer on the exported files.

The tests that run llama.cpp skip, saying why, where llama-cpp-python is not installed; the file's layout, the
errors and the command line are checked with the gguf package alone.
"""

import copy
import random
import sys

import numpy as np
import pytest
import torch
from conftest import needs_gpt2_bpe

gguf = pytest.importorskip("gguf", reason="the GGUF export needs the gguf package: pip install gguf")

from export import main as export_main  # noqa: E402
from gptkit import bpe, lora  # noqa: E402
from gptkit.checkpoint import save_checkpoint  # noqa: E402
from gptkit.generate import SamplingOptions, generate  # noqa: E402
from gptkit.gguf import GGUF_DTYPES, GGUFExportError, export_gguf, gguf_vocab  # noqa: E402
from gptkit.tokenizer import CHAT_SPECIALS, Tokenizer, with_tokenizer_files  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

try:
    import llama_cpp
except ImportError:  # an optional test dependency: it builds llama.cpp from source
    llama_cpp = None
needs_llama_cpp = pytest.mark.skipif(
    llama_cpp is None,
    reason="llama-cpp-python is not installed (pip install llama-cpp-python: it builds llama.cpp from source, "
    "~10-20 minutes): the exported files cannot be run",
)

# The text the trained model learns by heart (written for this test): its predictions on it are confident, so
# an argmax never hangs on a near-tie that rounding could flip.
PASSAGE = (
    "The lighthouse keeper counted the ships each evening, writing their names in a blue ledger. "
    "On calm nights he could hear the bell of the harbour, three miles away, and the gulls quarrelling "
    "over the fish market. In winter the storms came from the north, and he kept the lamp burning until "
    "dawn, trimming the wick every hour. His daughter, who lived in the town, sent him letters about the "
    "price of bread, the new school, and the neighbour's dog that had learned to open gates."
)

# Text that exercises every branch of the pre-tokenizer splits: contractions in both cases, digit runs,
# whitespace runs (spaces, tabs, newlines, CR LF, trailing), punctuation runs, accents, CJK, emoji with a
# modifier and a ZWJ sequence, code, and special tokens' names typed as text (ordinary text in both).
VARIED_TEXT = [
    "Hello, world! I'm here; they'll see. WE'RE DONE, isn't it? You've 'quoted' words.",
    "Numbers: 3.14159, 1,234,567 and 2024-06-01T12:00:00Z; 1000000000000 x 42.",
    "  leading spaces\tand\ttabs\n\nnew paragraph   \n   indented line\r\nwindows line   ",
    "Çà et là, naïve café, Straße, ελληνικά, русский текст, 日本語のテキスト, 中文字符, 한국어.",
    "Emoji 👍🏽 and 🇫🇷 flags, ZWJ 👨‍👩‍👧 family; math ∑∫√∞ ≠ ≤; arrows →←.",
    "def f(x):\n    return {'a': [x ** 2, x // 3]}  # comment\n\n\nif __name__ == '__main__':\n\tf(1)\n",
    "<|endoftext|> is text here, and so is <|user|>; <html><body class=\"x\">&amp;</body></html>",
    "   \n\n\n   ",
    "a",
    "",
]

# Pieces for random strings: what each pre-tokenizer regex branch treats specially (contractions in both cases,
# digits of several scripts, Unicode whitespace, combining marks, title case, emoji), glued at random.
PIECES = ["a", "Z", "é", "ß", "日", "ж", "٣", "7", "42", "12345", "'s", "'S", "'ll", "'LL", "'re", "'ve", "'m", "'d",
          "'t", "'x", " ", "  ", "\t", "\n", "\r\n", "\r", "\x0b", "\x0c", "\u00a0", "\u2003", "\u3000", "\u2028", ".",
          ",", "!?", "...", "—", "😀", "👍🏽", "\u0301", "ǅ", "Ⅻ", "½", "²", "_", "-", "$", "<|end|>", "&amp;"]


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(PIECES, k=rng.randint(1, 25))) for _ in range(n)]


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def our_logits(model: GPT, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0][0].numpy()


def llama(path, n_ctx: int = 0, **kwargs):
    """llama.cpp on the file, keeping the logits of every position (2 threads: the machine's cores)."""
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=2, n_threads_batch=2, logits_all=True,
                           verbose=False, **kwargs)


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


def llama_greedy(llm, prompt: list[int], n: int) -> list[int]:
    """llama.cpp's greedy continuation, token by token through its KV cache."""
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(out[-1:])
    return out


def assert_same_ids(llm, tokenizer: Tokenizer, texts: list[str]) -> None:
    """llama.cpp's tokenizer on the file gives our ids: ordinary text (special names typed as text
    included), and the special tokens themselves where parsing them is asked for."""
    for text in texts:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == tokenizer.encode(text), text
    for name, i in tokenizer.special.items():
        ids = llm.tokenize(f"hi{name}there".encode(), add_bos=False, special=True)
        assert ids == tokenizer.encode("hi") + [i] + tokenizer.encode("there"), name
        assert llm.detokenize([i], special=True).decode() == name


def bpe_corpus(n_lines: int = 3000, seed: int = 0) -> list[str]:
    """Lines built from PASSAGE's words and VARIED_TEXT's pieces: enough repeated structure for a few
    hundred merges of every kind (words, spaces, digits, punctuation, multi-byte characters)."""
    rng = random.Random(seed)
    words = PASSAGE.split() + " ".join(VARIED_TEXT).split()
    return [" ".join(rng.choices(words, k=rng.randint(3, 12))) + rng.choice([".", "\n", "\n\n", "  ", "!"])
            + str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(n_lines)]


# ----------------------------------------------------------------------------- a model on a trained tokenizer


@pytest.fixture(scope="module")
def trained_bpe(tmp_path_factory) -> tuple[Tokenizer, dict]:
    """A 600-id BPE trained here with the chat special tokens, and the meta a checkpoint stores for it (its
    files inline, so no data/ folder is needed)."""
    folder, _ = bpe.save(bpe.train(bpe_corpus(), 600, CHAT_SPECIALS, "tiny"), tmp_path_factory.mktemp("tok"))
    tokenizer = Tokenizer.from_folder(folder)
    return tokenizer, with_tokenizer_files({"tokenizer": tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size})


@pytest.fixture(scope="module")
def trained(trained_bpe):
    """A tiny GPT on the trained BPE (its 600 ids padded to 640 rows, as a scratch run's vocabulary is),
    trained to recite PASSAGE; and the passage's ids. n_embd is a multiple of 32, so every matrix can be q8_0."""
    tokenizer, _ = trained_bpe
    ids = torch.tensor(tokenizer.encode(PASSAGE))
    assert len(ids) > 100
    torch.manual_seed(0)
    config = GPTConfig(block_size=64, vocab_size=tokenizer.vocab_size, vocab_multiple=64, n_layer=2, n_head=2,
                       n_embd=64)
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    windows = torch.stack([ids[i : i + 65] for i in range(0, len(ids) - 64, 16)])  # (N, 65): every token
    for _ in range(120):
        _, loss = model(windows[:, :-1], windows[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert loss.item() < 0.1, f"the fixture's model did not learn its passage (loss {loss.item():.3f})"
    return model.eval(), ids.tolist()


@pytest.fixture(scope="module")
def exported(trained, trained_bpe, tmp_path_factory):
    """The trained model's GGUF files, one per dtype."""
    model, _ = trained
    _, meta = trained_bpe
    folder = tmp_path_factory.mktemp("gguf")
    return {dtype: export_gguf(model, folder / f"model-{dtype}.gguf", meta, dtype=dtype) for dtype in GGUF_DTYPES}


@needs_llama_cpp
def test_f32_file_computes_our_logits_and_decodes_our_tokens(trained, exported):
    model, ids = trained
    # An f32 KV cache: llama.cpp's default f16 one rounds keys and values, which on these logits (up to ~20)
    # alone moves them by ~1e-2; the file is checked here, not llama.cpp's cache (the f16 and q8_0 tests below
    # run with its defaults).
    f32_cache = dict(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm = llama(exported["f32"].path, model.config.block_size, **f32_cache)
    assert llm.n_vocab() == model.config.vocab_size  # the padding rows are not in the file

    window = ids[:64]
    ours, theirs = our_logits(model, window), llama_logits(llm, window)
    # llama.cpp computes GELU from an fp16 table: ~5e-3 apart on these logits, not 1e-6
    assert np.abs(ours - theirs).max() < 1e-2
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()

    prompt = ids[:16]
    out = generate(model, torch.tensor([prompt]), 32, SamplingOptions(temperature=0))[0, 16:].tolist()
    assert llama_greedy(llm, prompt, 32) == out
    llm.close()


@needs_llama_cpp
@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_f16_and_q8_0_files_agree_with_ours(trained, exported, dtype):
    model, ids = trained
    result = exported[dtype]
    assert result.fallback == []  # n_embd 64: every row is whole q8_0 blocks
    llm = llama(result.path, model.config.block_size)
    window = ids[:64]
    ours, theirs = our_logits(model, window), llama_logits(llm, window)
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.95
    # Rounding the weights moves the logits by a small fraction of their range (here 0.09% for f16, 1.8% for
    # q8_0), not more.
    assert np.abs(ours - theirs).max() < {"f16": 0.005, "q8_0": 0.05}[dtype] * np.abs(ours).max()
    llm.close()


def packed_logits(model: GPT, fmt: str, ids: list[int]) -> torch.Tensor:
    """The logits of `model` packed in `fmt` for the CPU kernels (or torch's products where they cannot run)
    after ids[:8] at once (prefill), then after each further id, one at a time through the KV cache (the
    decode path): positions 7 to len(ids) - 1."""
    from gptkit.cpu_decode import pack_for_cpu
    from gptkit.generate import decode_one_token, prefill

    packed = pack_for_cpu(copy.deepcopy(model), fmt)
    packed.setup_kv_cache(1)
    with torch.no_grad():
        rows = [prefill(packed, torch.tensor([ids[:8]]), torch.arange(8))]
        for t in range(8, len(ids)):
            rows.append(decode_one_token(packed, torch.tensor([[ids[t]]]), torch.tensor([t]), length=t + 1))
    return torch.cat(rows)


def test_files_read_back_are_the_models_that_wrote_them(trained, trained_bpe, exported):
    """Our reader (sample.py, chat.py, serve.py --ckpt FILE.gguf) gives back the model and tokenizer: an f32
    file the very weights; a q4_0 file, packed with --quantize=q4_0, our own q4_0 model's logits, equal to the
    bit (the same blocks: our quantizer is llama.cpp's and idempotent); a q8_0 file the weights rounded as
    q8_0."""
    from gptkit.cpu_decode import quantize_q8_0
    from gptkit.gguf_load import is_gguf, load_gguf

    model, ids = trained
    tokenizer, _ = trained_bpe
    back, back_tokenizer, what = load_gguf(exported["f32"].path)
    assert is_gguf(exported["f32"].path) and "GGUF" in what
    assert back_tokenizer.to_meta() == tokenizer.to_meta() and back.config == model.config
    state, ours = back.state_dict(), model.state_dict()
    V = model.config.vocab_size
    for key, value in ours.items():
        rows = slice(0, V) if key in ("transformer.wte.weight", "lm_head.weight") else slice(None)
        assert torch.equal(state[key][rows], value[rows]), key
    window = ids[:40]
    assert torch.equal(packed_logits(load_gguf(exported["q4_0"].path)[0], "q4_0", window),
                       packed_logits(model, "q4_0", window))
    q8 = load_gguf(exported["q8_0"].path)[0].state_dict()["transformer.h.1.mlp.c_fc.weight"]
    q, scale = quantize_q8_0(ours["transformer.h.1.mlp.c_fc.weight"])
    assert torch.equal(q8, (q.reshape(q.size(0), -1, 32) * scale[..., None]).reshape(q.shape))


def test_an_untied_model_without_biases_reads_back_exactly(tmp_path):
    """An untied head (the file's `output`, q8_0 at q4_0 like token_embd) and no biases (the file's zero biases
    are dropped): the q4_0 file read back and packed is our own q4_0 model, logit for logit."""
    from gptkit.gguf_load import load_gguf

    tokenizer = Tokenizer.char_from_text(CHARS_TEXT)
    torch.manual_seed(2)
    config = GPTConfig(block_size=32, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, n_embd=64,
                       bias=False, tie_embeddings=False)
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    result = export_gguf(model, tmp_path / "m.gguf", {"tokenizer": tokenizer.to_meta()}, dtype="q4_0")
    tensors = read(result.path)[1]
    assert tensors["output.weight"][0] == "Q8_0" and tensors["token_embd.weight"][0] == "Q8_0"
    back, _, _ = load_gguf(result.path)
    assert not back.config.bias and not back.config.tie_embeddings
    ids = tokenizer.encode(CHARS_TEXT)[:32]
    assert torch.equal(packed_logits(back, "q4_0", ids), packed_logits(model, "q4_0", ids))


def wide_model(tied: bool, seed: int = 4) -> tuple[GPT, Tokenizer]:
    """A random model of n_embd 256 (whole Q6_K super-blocks: its q4_0 head is q6_k) on a character
    vocabulary, its weights moved off their initial values (an untied head starts at zero)."""
    tokenizer = Tokenizer.char_from_text(CHARS_TEXT)
    torch.manual_seed(seed)
    config = GPTConfig(block_size=32, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=4, n_embd=256,
                       tie_embeddings=tied)
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model, tokenizer


@pytest.mark.parametrize("tied", [True, False])
def test_a_q4_0_file_with_q6_k_head_reads_back_exactly(tmp_path, tied):
    """n_embd 256: the q4_0 file holds token_embd (and an untied head's output) as Q6_K, as llama-quantize
    would; read back and packed with --quantize=q4_0 it is our own q4_0 model (head q6_k), logit for logit:
    the file's Q6_K blocks are packed as they are."""
    from gptkit import cpu_decode
    from gptkit.cpu_decode import pack_for_cpu
    from gptkit.gguf_load import load_gguf

    model, tokenizer = wide_model(tied)
    result = export_gguf(model, tmp_path / "m.gguf", {"tokenizer": tokenizer.to_meta()}, dtype="q4_0")
    tensors = read(result.path)[1]
    assert tensors["token_embd.weight"][0] == "Q6_K" and tensors["blk.0.ffn_up.weight"][0] == "Q4_0"
    assert ("output.weight" in tensors) == (not tied) and tensors.get("output.weight", ("Q6_K",))[0] == "Q6_K"
    assert result.head.startswith("token embedding q6_k")
    back, _, what = load_gguf(result.path)
    assert "q6_k" in what and sorted(back.gguf_q6_k) == ["lm_head.weight", "transformer.wte.weight"]
    blocks = cpu_decode.from_q6_k_blocks(torch.tensor(back.gguf_q6_k["transformer.wte.weight"]), 256)
    again = cpu_decode.quantize_q6_k(cpu_decode.dequantize_q6_k(*blocks))  # quantized again, the file's values
    assert not all(torch.equal(a, b) for a, b in zip(again, blocks))  # give other blocks: the loader carries them
    packed = pack_for_cpu(copy.deepcopy(back), "q4_0")
    assert packed.lm_head.fmt == "q6_k" and not hasattr(packed, "gguf_q6_k")  # used, then let go
    ids = tokenizer.encode(CHARS_TEXT)[:32]
    assert torch.equal(packed_logits(back, "q4_0", ids), packed_logits(model, "q4_0", ids))


def test_other_gguf_files_are_one_line_errors(tmp_path):
    from gptkit.gguf_load import GGUFLoadError, load_gguf

    writer = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "gpt2")  # llama.cpp's own, without our keys
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFLoadError, match="was not written by export.py") as e:
        load_gguf(tmp_path / "other.gguf")
    one_line(e)
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(GGUFLoadError, match="cannot read") as e:
        load_gguf(tmp_path / "broken.gguf")
    one_line(e)


@needs_llama_cpp
def test_q4_0_file_agrees_with_our_q4_0_model(trained, exported):
    """llama.cpp loads our q4_0 file (blocks in Q4_0, the tied token embedding in Q8_0) and its logits are
    close to our own q4_0 model's: the same weights; both quantize the activations to q8_0 for the
    products, at different points and with different sums, so not to the bit."""
    model, ids = trained
    result = exported["q4_0"]
    assert result.fallback == []
    fields, tensors = read(result.path)
    assert fields["general.file_type"] == 2  # MOSTLY_Q4_0
    assert tensors["blk.0.ffn_up.weight"][0] == "Q4_0" and tensors["token_embd.weight"][0] == "Q8_0"
    llm = llama(result.path, model.config.block_size)
    window = ids[:64]
    ours = packed_logits(model, "q4_0", window).numpy()  # positions 7 to 63
    theirs, reference = llama_logits(llm, window)[7:], our_logits(model, window)[7:]  # reference: float32
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.95
    # the two q4_0 models are much closer to each other than to the float32 model (measured: 0.16 apart on
    # logits up to 21, each ~2 from float32's)
    assert np.abs(ours - theirs).max() < 0.02 * np.abs(ours).max()
    assert np.abs(ours - theirs).max() < 0.25 * np.abs(ours - reference).max()
    llm.close()


@needs_llama_cpp
@pytest.mark.parametrize("tied", [True, False])
def test_q4_0_file_with_a_q6_k_head_agrees_with_our_q4_0_model(tmp_path, tied):
    """llama.cpp reads our Q6_K token_embd (and output) and computes with the very values our q6_k head
    holds: its logits are close to our q4_0 model's (the activations rounded at different points, not to the
    bit), much closer than to the float32 model's, and closer than to our q4_0 model with a q8_0 head (the
    same blocks, another head), which they would match as well were llama.cpp's head values not ours."""
    from gptkit.cpu_decode import PackedLinear, pack_for_cpu

    model, tokenizer = wide_model(tied)
    result = export_gguf(model, tmp_path / "m.gguf", {"tokenizer": tokenizer.to_meta()}, dtype="q4_0")
    llm = llama(result.path, model.config.block_size)
    ids = tokenizer.encode(CHARS_TEXT)[:32]
    theirs, reference = llama_logits(llm, ids)[7:], our_logits(model, ids)[7:]
    llm.close()
    ours = packed_logits(model, "q4_0", ids).numpy()
    q6 = pack_for_cpu(copy.deepcopy(model), "q4_0")
    q8_head = PackedLinear(model.lm_head.weight[: model.config.vocab_size], None, "q8_0")
    with torch.no_grad():  # the same hidden states through our q6_k head and through a q8_0 one
        hidden = q6.hidden_states(torch.tensor([ids]))[0, 7:]
        same_head, other_head = q6.lm_head(hidden).numpy(), q8_head(hidden).numpy()
    apart = np.abs(ours - theirs).max()
    # measured: 0.03-0.04 apart on logits up to 2-3, each ~0.5 from float32's
    assert apart < 0.03 * np.abs(ours).max()
    assert apart < 0.2 * np.abs(ours - reference).max()
    assert np.abs(same_head - theirs).max() < np.abs(other_head - theirs).max()


@needs_llama_cpp
def test_trained_tokenizer_in_the_file_gives_our_ids(trained_bpe, exported):
    tokenizer, _ = trained_bpe
    llm = llama_cpp.Llama(model_path=str(exported["f32"].path), vocab_only=True, verbose=False)
    assert_same_ids(llm, tokenizer, VARIED_TEXT + bpe_corpus(200, seed=1) + random_texts(1000))
    # <|endoftext|> is BOS and EOS; <|end|> ends a chat turn, so llama.cpp stops generating there
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    assert llm.token_bos() == llm.token_eos() == tokenizer.special["<|endoftext|>"]
    assert llama_cpp.llama_vocab_eot(vocab) == tokenizer.special["<|end|>"]
    assert llama_cpp.llama_vocab_is_eog(vocab, tokenizer.special["<|end|>"])
    llm.close()


@needs_llama_cpp
def test_chat_template_in_the_file_renders_our_prompt_ids(trained_bpe, tmp_path):
    """A chat model's file carries our template: rendered from the file (by llama-cpp-python's Jinja, as its
    chat completion does) and tokenized by llama.cpp, a conversation is exactly our prompt's ids."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from gptkit.chat import HF_CHAT_TEMPLATE, render

    tokenizer, meta = trained_bpe
    model = GPT(GPTConfig(block_size=16, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=2, n_embd=32))
    result = export_gguf(model, tmp_path / "chat.gguf", meta, chat_template=HF_CHAT_TEMPLATE)
    llm = llama_cpp.Llama(model_path=str(result.path), vocab_only=True, verbose=False)
    template = llm.metadata["tokenizer.chat_template"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi! Who's there?"},
                {"role": "assistant", "content": "The keeper, 3 miles away."}, {"role": "user", "content": "Why?"}]
    prompt = Jinja2ChatFormatter(template, eos_token="<|endoftext|>", bos_token="<|endoftext|>")(messages=messages)
    ids = llm.tokenize(prompt.prompt.encode(), add_bos=False, special=True)
    assert ids == render(messages, tokenizer, add_generation_prompt=True)[0]
    llm.close()


# ----------------------------------------------------------------------------- GPT-2's BPE, characters


def read(path) -> tuple[dict, dict]:
    """(metadata key -> value, tensor name -> (type name, ggml shape)) of a GGUF file, through gguf's reader
    (slow for a 50K vocabulary: ~100K strings become numpy views)."""
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape)) for t in reader.tensors}
    return fields, tensors


@needs_gpt2_bpe
def test_gpt2_vocabulary_in_llama_cpps_form():
    tokenizer = Tokenizer.tiktoken("gpt2").with_special(CHAT_SPECIALS)
    vocab = gguf_vocab({"tokenizer": tokenizer.to_meta()}, 50304)  # a model with padded rows
    assert vocab.pre == "gpt-2" and len(vocab.tokens) == len(vocab.types) == 50304
    assert vocab.tokens[220] == "Ġ" and vocab.tokens[198] == "Ċ"  # GPT-2's printable bytes
    assert vocab.merges[0] == "Ġ t" and len(vocab.merges) == 50000
    assert vocab.tokens[50256:50261] == list(CHAT_SPECIALS)  # <|endoftext|>, then the chat tokens
    assert set(vocab.types[50256:50261]) == {gguf.TokenType.CONTROL}
    assert vocab.tokens[50261] == "[PAD50261]" and set(vocab.types[50261:]) == {gguf.TokenType.UNUSED}
    assert (vocab.bos_eos, vocab.eot) == (50256, tokenizer.special["<|end|>"])


@needs_llama_cpp
@needs_gpt2_bpe
def test_gpt2_file_computes_our_logits_and_tokenizes_like_tiktoken(tmp_path):
    """A random tiny GPT on GPT-2's BPE with the chat special tokens (ids 50257-50260, inside the padded
    rows): random weights, so the logits are compared, not argmaxes."""
    tokenizer = Tokenizer.tiktoken("gpt2").with_special(CHAT_SPECIALS)
    torch.manual_seed(2)
    model = GPT(GPTConfig(block_size=32, vocab_size=tokenizer.vocab_size, vocab_multiple=64, n_layer=2, n_head=2,
                          n_embd=32)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms' gains away from one, biases away from zero
    meta = {"tokenizer": tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size}
    result = export_gguf(model, tmp_path / "gpt2.gguf", meta, chat_template="{{ messages }}")

    llm = llama(result.path, 32)
    assert llm.metadata["tokenizer.chat_template"] == "{{ messages }}"
    assert_same_ids(llm, tokenizer, VARIED_TEXT + [PASSAGE] + random_texts(1000))
    ids = tokenizer.encode(PASSAGE)[:32]
    assert np.abs(our_logits(model, ids) - llama_logits(llm, ids)).max() < 1e-2
    llm.close()


CHARS_TEXT = "First Citizen:\nBefore we proceed any further, hear me speak — é, ü, 日本, 👍!\n\tAll: 'Speak, speak.'"


@needs_llama_cpp
def test_character_model_untied_and_without_bias_exports_exactly(tmp_path):
    """A character vocabulary with special tokens (multi-byte characters included), an untied head and no
    biases: each carried into llama.cpp's gpt2 by its own means (merges that only rebuild characters, an
    `output` tensor, zero biases). Random weights: the logits are compared, not argmaxes."""
    tokenizer = Tokenizer.char_from_text(CHARS_TEXT).with_special(CHAT_SPECIALS)
    meta = {"tokenizer": tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size}
    torch.manual_seed(1)
    config = GPTConfig(block_size=48, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=4, n_embd=32,
                       bias=False, tie_embeddings=False)
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms' gains away from one, a head unlike the embedding
    result = export_gguf(model, tmp_path / "char.gguf", meta)
    assert "output.weight" in read(result.path)[1]

    llm = llama(result.path, 48)
    assert_same_ids(llm, tokenizer, [CHARS_TEXT, CHARS_TEXT[::-1], "  \n\n'é'", "speak, speak"])
    ids = tokenizer.encode(CHARS_TEXT)[:48]
    assert np.abs(our_logits(model, ids) - llama_logits(llm, ids)).max() < 1e-2
    llm.close()


# ----------------------------------------------------------------------------- the file's layout


def test_file_layout_follows_llama_cpp_gpt2(trained_bpe, tmp_path):
    tokenizer, meta = trained_bpe
    config = GPTConfig(block_size=32, vocab_size=tokenizer.vocab_size, vocab_multiple=64, n_layer=2, n_head=2,
                       n_embd=48, ln_eps=1e-3)
    torch.manual_seed(0)
    model = GPT(config).eval()
    result = export_gguf(model, tmp_path / "m.gguf", meta, dtype="q8_0")
    fields, tensors = read(result.path)
    assert fields["general.architecture"] == "gpt2" and fields["general.file_type"] == 7  # MOSTLY_Q8_0
    assert (fields["gpt2.context_length"], fields["gpt2.embedding_length"], fields["gpt2.block_count"],
            fields["gpt2.attention.head_count"], fields["gpt2.feed_forward_length"]) == (32, 48, 2, 2, 192)
    assert fields["gpt2.attention.layer_norm_epsilon"] == pytest.approx(1e-3)
    # GPT-4's split (the trained BPE's): llama.cpp's llama-bpe, which also looks whole pieces up like tiktoken
    assert fields["tokenizer.ggml.pre"] == "llama-bpe" and len(fields["tokenizer.ggml.tokens"]) == 600
    assert "tokenizer.chat_template" not in fields

    # 48 is not a multiple of q8_0's 32-value blocks: those matrices fall back to f16, as llama.cpp's converter
    # does (ffn_down's rows are 4 * 48 = 192 long: that one is q8_0); vectors and positions stay f32.
    assert tensors["token_embd.weight"] == ("F16", (48, 600))  # ggml order {n_embd, n_vocab}: no padding rows
    assert tensors["position_embd.weight"] == ("F32", (48, 32))
    assert tensors["blk.1.attn_qkv.weight"] == ("F16", (48, 144))
    assert tensors["blk.1.ffn_down.weight"] == ("Q8_0", (192, 48))
    assert tensors["blk.0.attn_norm.bias"] == ("F32", (48,)) and tensors["output_norm.weight"] == ("F32", (48,))
    assert "output.weight" not in tensors  # tied: llama.cpp reuses token_embd as the head
    assert sorted(result.fallback) == sorted(n for n, (t, _) in tensors.items() if t == "F16")
    assert len(tensors) == 4 + 12 * config.n_layer

    # The values: an f32 file holds our tensors bit for bit, under llama.cpp's names.
    export_gguf(model, tmp_path / "m32.gguf", meta)
    data = {t.name: np.array(t.data) for t in gguf.GGUFReader(tmp_path / "m32.gguf").tensors}
    state = model.state_dict()
    assert np.array_equal(data["token_embd.weight"], state["transformer.wte.weight"][:600].numpy())
    assert np.array_equal(data["blk.1.attn_qkv.weight"], state["transformer.h.1.attn.c_attn.weight"].numpy())
    assert np.array_equal(data["blk.0.ffn_down.bias"], state["transformer.h.0.mlp.c_proj.bias"].numpy())


# ----------------------------------------------------------------------------- what cannot be exported


def test_modern_options_are_one_line_errors(tmp_path):
    meta = {"tokenizer": {"kind": "char", "chars": list("abcd")}}
    modern = GPT(GPTConfig(block_size=8, vocab_size=4, n_layer=1, n_head=2, n_embd=32, arch="modern"))
    with pytest.raises(GGUFExportError) as e:
        export_gguf(modern, tmp_path / "m.gguf", meta)
    message = one_line(e)
    for option in ("rope=True", "norm='rmsnorm'", "qk_norm=True", "activation='relu2'", "logit_softcap=15.0"):
        assert option in message
    assert "tie_embeddings" not in message and "bias" not in message  # both carried: output.weight, zero biases
    one = GPT(GPTConfig(block_size=8, vocab_size=4, n_layer=1, n_head=2, n_embd=32, logit_softcap=30.0))
    with pytest.raises(GGUFExportError, match=r"^this model cannot be exported to GGUF: logit_softcap=30.0 has no"):
        export_gguf(one, tmp_path / "m.gguf", meta)
    assert not (tmp_path / "m.gguf").exists()


def test_tokenizers_that_cannot_be_carried_are_one_line_errors(tmp_path):
    model = GPT(GPTConfig(block_size=8, vocab_size=4, n_layer=1, n_head=2, n_embd=32))
    cases = {
        "names no tokenizer": None,
        "cannot be rebuilt: unknown tokenizer kind 'sentencepiece'": {"tokenizer": {"kind": "sentencepiece"}},
        "the tokenizer has 5 tokens, but the model only 4": {"tokenizer": {"kind": "char", "chars": list("abcde")}},
    }
    for expected, meta in cases.items():
        with pytest.raises(GGUFExportError) as e:
            export_gguf(model, tmp_path / "m.gguf", meta)
        assert expected in one_line(e)
    assert not (tmp_path / "m.gguf").exists()


def test_without_the_gguf_package_the_error_says_how_to_install_it(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # what `import gguf` finds when it is not installed
    with pytest.raises(GGUFExportError) as e:
        export_gguf(tiny_model, tmp_path / "m.gguf", {"tokenizer": {"kind": "char", "chars": list("ab")}})
    assert "pip install gguf" in one_line(e)


# ----------------------------------------------------------------------------- export.py --format gguf


def test_export_cli_writes_gguf_and_refuses_bad_input(tmp_path, tiny_model, tiny_config, capsys):
    chars = [chr(c) for c in range(ord("A"), ord("A") + tiny_config.vocab_size)]  # some are 2 bytes in UTF-8
    ckpt = {"format": 1, "model_config": tiny_config.to_dict(), "model": tiny_model.state_dict(),
            "tokenizer": {"tokenizer": {"kind": "char", "chars": chars}, "vocab_size": len(chars)}, "step": 7}
    save_checkpoint(ckpt, tmp_path / "out" / "best.pt")
    out = tmp_path / "model.gguf"
    export_main(["--ckpt", str(tmp_path / "out"), "--format", "gguf", "--out", str(out), "--dtype", "f16"])
    printed = capsys.readouterr().out
    assert "exported the step-7 model" in printed and f"to {out}" in printed and "f16 weights" in printed
    assert f"llama-completion -m {out}" in printed
    export_main(["--ckpt", str(tmp_path / "out"), "--format", "gguf", "--out", str(out), "--dtype", "q8_0",
                 "--overwrite"])
    assert "note:" not in capsys.readouterr().out  # n_embd 32: every row is one q8_0 block
    assert read(out)[1]["blk.0.attn_qkv.weight"][0] == "Q8_0"
    before = out.read_bytes()

    def error_of(*argv):
        with pytest.raises(SystemExit) as e:
            export_main(["--ckpt", str(tmp_path / "out"), *argv])
        message = str(e.value.code)
        assert message.startswith("error: ") and "\n" not in message, message
        return message

    assert "already exists" in error_of("--format", "gguf", "--out", str(out))
    assert "dtype must be one of f32, f16, q8_0, q4_0; got 'q4_k'" in error_of("--format", "gguf", "--out", str(out),
                                                                         "--dtype", "q4_k")
    assert "format must be one of hf, gguf, pt; got 'onnx'" in error_of("--format", "onnx", "--out", str(out))
    assert "--format gguf needs --out FILE" in error_of("--format", "gguf")
    assert "--out and --to are two spellings of out" in error_of("--format", "gguf", "--out", str(out), "--to",
                                                                 str(tmp_path))
    assert "--dtype is for --format gguf" in error_of("--to", str(tmp_path / "hf"), "--dtype", "f16")
    assert "is a folder" in error_of("--format", "gguf", "--out", str(tmp_path), "--overwrite")
    assert out.read_bytes() == before  # nothing a failed run touched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "out"]  # no temporary file left


def test_lora_checkpoint_exports_merged(tmp_path, tiny_model, tiny_config):
    """A LoRA checkpoint (adapters only) exports as its base with the adapters folded in."""
    chars = [chr(c) for c in range(ord("A"), ord("A") + tiny_config.vocab_size)]
    meta = {"tokenizer": {"kind": "char", "chars": chars}, "vocab_size": len(chars)}
    base_path = tmp_path / "base" / "best.pt"
    save_checkpoint({"format": 1, "model_config": tiny_config.to_dict(), "model": tiny_model.state_dict(),
                     "tokenizer": meta, "step": 1}, base_path)
    settings = lora.LoRASettings(rank=2, targets="attn.c_attn,mlp.c_fc")
    info = {"settings": settings.to_dict(), "base": {"init_from": str(base_path),
                                                     "fingerprint": lora.fingerprint(tiny_model.state_dict())}}
    adapted = lora.apply(GPT(tiny_config), settings)
    adapted.load_state_dict(tiny_model.state_dict(), strict=False)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(std=0.1)  # a trained adapter: not zero
    save_checkpoint({"format": 1, "model_config": tiny_config.to_dict(), "model": lora.adapter_state_dict(adapted),
                     "lora": info, "tokenizer": meta, "step": 2}, tmp_path / "lora" / "last.pt")

    export_main(["--ckpt", str(tmp_path / "lora"), "--format", "gguf", "--out", str(tmp_path / "lora.gguf")])
    export_gguf(lora.merge(adapted), tmp_path / "merged.gguf", meta)
    export_gguf(tiny_model, tmp_path / "base.gguf", meta)
    exported, merged, base = ({t.name: np.array(t.data) for t in gguf.GGUFReader(tmp_path / f"{n}.gguf").tensors}
                              for n in ("lora", "merged", "base"))
    for name, value in exported.items():
        assert np.array_equal(value, merged[name]), name
        targeted = name.endswith(("attn_qkv.weight", "ffn_up.weight"))
        assert np.array_equal(value, base[name]) != targeted, name
