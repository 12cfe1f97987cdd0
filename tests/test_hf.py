"""Hugging Face GPT-2 interop (hf_gpt2.py, export.py), checked against `transformers` itself.

No network: every "pretrained" model is a tiny random GPT2LMHeadModel saved into tmp_path.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from export import export_hf  # noqa: E402
from export import main as export_main  # noqa: E402
from gptkit import hf_gpt2  # noqa: E402
from gptkit.checkpoint import save_checkpoint  # noqa: E402
from gptkit.generate import SamplingOptions, generate  # noqa: E402
from gptkit.hf_gpt2 import HFGPT2Error, hf_to_ours, load_pretrained, ours_to_hf  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

# GPT2Config fields of the tiny test models. Beside the shapes (an odd head count, contexts < 1024), they set a
# non-default layer_norm_epsilon and options that are spelled differently but compute GPT-2's function.
SHAPES = {
    "small": dict(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=97),
    "odd-heads": dict(
        n_layer=1,
        n_head=3,
        n_embd=48,
        n_positions=64,
        vocab_size=101,
        layer_norm_epsilon=1e-3,
        activation_function="gelu_pytorch_tanh",
    ),
    "deeper": dict(
        n_layer=3,
        n_head=4,
        n_embd=64,
        n_positions=128,
        vocab_size=130,
        n_inner=256,  # = 4 * n_embd, written out
        reorder_and_upcast_attn=True,  # only changes fp16 rounding
    ),
}


def make_hf(seed: int = 0, **fields):
    """A random GPT2LMHeadModel in eval mode. Every parameter gets noise, so LayerNorm gains and biases are
    not the trivial ones/zeros and a mis-mapped tensor changes the logits."""
    config = transformers.GPT2Config(**{"bos_token_id": None, "eos_token_id": None, **fields})
    torch.manual_seed(seed)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return hf


def save_hf(hf, folder, fmt: str = "safetensors"):
    if fmt == "safetensors":
        hf.save_pretrained(folder)
    else:  # transformers 5 no longer writes .bin files itself: config plus a torch.save'd state dict
        hf.config.save_pretrained(folder)
        torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    return folder


def assert_logits_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    err = (ours - theirs).abs().max().item()
    assert err <= 1e-5 * theirs.abs().max().item(), f"max logit difference {err}"


def hf_logits(hf, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(idx).logits


def our_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx)[0]


def tokens(vocab_size: int, shape=(2, 12), seed: int = 1) -> torch.Tensor:
    return torch.randint(vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def hf_folder(tmp_path):
    """A saved tiny GPT-2 folder and the transformers model it holds."""
    hf = make_hf(**SHAPES["small"])
    return save_hf(hf, tmp_path / "tiny-gpt2"), hf


# ----------------------------------------------------------------------------- loading


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_loaded_model_matches_transformers(tmp_path, shape, fmt):
    fields = SHAPES[shape]
    hf = make_hf(**fields)
    folder = save_hf(hf, tmp_path / "m", fmt)
    model = load_pretrained(str(folder))

    c = model.config
    assert (c.n_layer, c.n_head, c.n_embd, c.block_size, c.vocab_size) == (
        fields["n_layer"],
        fields["n_head"],
        fields["n_embd"],
        fields["n_positions"],
        fields["vocab_size"],
    )
    assert c.ln_eps == fields.get("layer_norm_epsilon", 1e-5) and c.bias and c.dropout == 0.0
    assert not model.training

    idx = tokens(c.vocab_size, (2, fields["n_positions"]))  # the full context
    assert_logits_close(our_logits(model, idx), hf_logits(hf, idx))

    prompt, n = tokens(c.vocab_size, (2, 5), seed=2), 16
    ours = generate(model, prompt, n, SamplingOptions(temperature=0))
    with torch.no_grad():
        theirs = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n, pad_token_id=0
        )
    assert torch.equal(ours, theirs)


def test_openai_style_keys_and_buffers(tmp_path):
    """Like OpenAI's own upload: keys without `transformer.`, the attention mask buffers, no lm_head."""
    hf = make_hf(**SHAPES["small"])
    folder = tmp_path / "openai"
    hf.config.save_pretrained(folder)
    state = {k.removeprefix("transformer."): v.contiguous() for k, v in hf.state_dict().items()}
    state.pop("lm_head.weight", None)
    n = hf.config.n_positions
    for i in range(hf.config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    from safetensors.torch import save_file

    save_file(state, str(folder / "model.safetensors"))
    model = load_pretrained(str(folder))
    idx = tokens(hf.config.vocab_size)
    assert_logits_close(our_logits(model, idx), hf_logits(hf, idx))


def test_sharded_safetensors(tmp_path):
    hf = make_hf(**SHAPES["small"])
    folder = tmp_path / "sharded"
    hf.save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    model = load_pretrained(str(folder))
    idx = tokens(hf.config.vocab_size)
    assert_logits_close(our_logits(model, idx), hf_logits(hf, idx))


def test_half_precision_file_loads_as_float32(tmp_path):
    hf = make_hf(**SHAPES["small"])
    folder = tmp_path / "fp16"
    hf.half().save_pretrained(folder)
    model = load_pretrained(str(folder))
    assert model.transformer.wte.weight.dtype == torch.float32
    assert torch.equal(model.transformer.wte.weight[:97], hf.transformer.wte.weight.float())


@pytest.mark.parametrize(
    "field, value",
    [
        ("activation_function", "relu"),
        ("n_inner", 100),
        ("scale_attn_weights", False),
        ("scale_attn_by_inverse_layer_idx", True),
        ("add_cross_attention", True),
        ("tie_word_embeddings", False),
        ("model_type", "gpt_neo"),
    ],
)
def test_unsupported_config_fields_are_refused(hf_folder, field, value):
    folder, _ = hf_folder
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFGPT2Error) as e:
        load_pretrained(str(folder))
    message = str(e.value)
    assert field in message and repr(value) in message and "\n" not in message


def test_missing_config_field(hf_folder):
    folder, _ = hf_folder
    config = json.loads((folder / "config.json").read_text())
    del config["n_head"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFGPT2Error, match="n_head is missing"):
        load_pretrained(str(folder))


def test_weight_problems_name_the_keys(tmp_path, hf_folder):
    folder, hf = hf_folder
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    hf.config.save_pretrained(tmp_path / "bad")
    path = tmp_path / "bad" / "pytorch_model.bin"

    torch.save({k: v for k, v in state.items() if k != "transformer.h.1.mlp.c_fc.bias"}, path)
    with pytest.raises(HFGPT2Error, match=r"missing for transformer\.h\.1\.mlp\.c_fc\.bias"):
        load_pretrained(str(tmp_path / "bad"))

    torch.save({**state, "transformer.h.0.attn.c_proj.weight": torch.zeros(3, 3)}, path)
    with pytest.raises(HFGPT2Error, match=r"transformer\.h\.0\.attn\.c_proj\.weight has shape \(3, 3\)"):
        load_pretrained(str(tmp_path / "bad"))

    torch.save({**state, "score.weight": torch.zeros(2, 32)}, path)
    with pytest.raises(HFGPT2Error, match=r"unexpected weights score\.weight"):
        load_pretrained(str(tmp_path / "bad"))

    path.write_bytes(b"not a pickle")
    with pytest.raises(HFGPT2Error, match="cannot read weights"):
        load_pretrained(str(tmp_path / "bad"))


def test_bad_names_and_folders(tmp_path):
    with pytest.raises(HFGPT2Error, match="gpt2, gpt2-medium, gpt2-large, gpt2-xl") as e:
        load_pretrained("gpt3")
    assert "local folder" in str(e.value)
    with pytest.raises(HFGPT2Error, match="has no config.json"):
        load_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(HFGPT2Error, match="no model.safetensors or pytorch_model.bin"):
        load_pretrained(str(tmp_path))
    with pytest.raises(HFGPT2Error, match="is a file; pass the folder"):
        load_pretrained(str(tmp_path / "config.json"))


def test_no_network_error_names_the_file(monkeypatch, hf_folder):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(repo_id, filename, **kwargs):
        raise LocalEntryNotFoundError("Cannot reach the Hub.\nSecond line of details.")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    # the Hub answers a connection, the download fails (tests/test_walkthrough.py: a Hub that cannot be reached)
    monkeypatch.setattr(hf_gpt2, "hub_unreachable", lambda: None)
    with pytest.raises(HFGPT2Error) as e:
        load_pretrained("gpt2")
    message = str(e.value)
    assert "config.json" in message and "'gpt2'" in message and "local folder" in message
    assert "Cannot reach the Hub" in message and "\n" not in message

    # config.json from the cache, the weights not: the message names the weights file.
    folder, _ = hf_folder

    def config_only(repo_id, filename, **kwargs):
        assert repo_id == "openai-community/gpt2-medium"
        if filename == "config.json":
            return str(folder / "config.json")
        raise OSError("connection refused")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", config_only)
    with pytest.raises(HFGPT2Error, match="could not download model.safetensors of 'gpt2-medium'"):
        load_pretrained("gpt2-medium")


def test_block_size_override_crops(hf_folder):
    folder, hf = hf_folder
    model = load_pretrained(str(folder), block_size=16)
    assert model.config.block_size == 16 and model.transformer.wpe.weight.shape == (16, 32)
    idx = tokens(hf.config.vocab_size, (2, 16))
    assert_logits_close(our_logits(model, idx), hf_logits(hf, idx))

    assert load_pretrained(str(folder), block_size=32).config.block_size == 32  # the full size is no crop
    with pytest.raises(HFGPT2Error, match="block_size 64 is larger than .* 32 positions"):
        load_pretrained(str(folder), block_size=64)
    with pytest.raises(HFGPT2Error, match="positive integer"):
        load_pretrained(str(folder), block_size=0)


def test_key_mapping_is_one_table_both_ways(tiny_model):
    """hf_to_ours undoes ours_to_hf; the tied head is never written and ignored when read, with or without
    the `transformer.` prefix; the attention-mask buffers are skipped."""
    ours = tiny_model.state_dict()
    hf = dict(filter(None, (ours_to_hf(k, v) for k, v in ours.items())))
    assert "lm_head.weight" not in hf and hf["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
    back = dict(filter(None, (hf_to_ours(k, v) for k, v in hf.items())))
    assert back.keys() == ours.keys() - {"lm_head.weight"}
    assert all(torch.equal(back[k], ours[k]) for k in back)
    key, tensor = hf_to_ours("h.1.mlp.c_fc.weight", hf["transformer.h.1.mlp.c_fc.weight"])  # OpenAI's keys
    assert key == "transformer.h.1.mlp.c_fc.weight" and torch.equal(tensor, ours[key])
    for key in ("lm_head.weight", "transformer.lm_head.weight", "h.0.attn.bias", "h.3.attn.masked_bias"):
        assert hf_to_ours(key, torch.zeros(1)) is None, key


def test_dropout_override(hf_folder):
    folder, _ = hf_folder
    assert load_pretrained(str(folder)).config.dropout == 0.0  # not HF's 0.1: the default is for evaluation
    model = load_pretrained(str(folder), dropout=0.1)
    assert model.config.dropout == 0.1
    assert model.transformer.drop.p == 0.1 and model.transformer.h[0].attn.dropout == 0.1
    with pytest.raises(ValueError, match="dropout"):
        load_pretrained(str(folder), dropout=1.5)
    with pytest.raises(HFGPT2Error, match="cannot override n_layer"):
        load_pretrained(str(folder), n_layer=3)


@pytest.mark.parametrize("shape", ["small", "deeper"])
def test_vocabulary_is_padded_on_load_and_never_shows(tmp_path, monkeypatch, shape):
    """GPT-2 weights load with the embedding rounded up to a multiple of 64 rows (zeros), like a scratch run's:
    the logits, the loss (whichever way it is computed) and the exported file are still exactly GPT-2's."""
    from safetensors.torch import load_file

    import model as model_module

    hf = make_hf(**SHAPES[shape])
    folder = save_hf(hf, tmp_path / "m")
    model = load_pretrained(str(folder))
    V = hf.config.vocab_size
    wte = model.transformer.wte.weight
    assert wte.shape[0] % 64 == 0 and wte.shape[0] > V and model.config.vocab_size == V
    assert model.lm_head.weight is wte and not wte[V:].any()  # the padding rows are zero

    idx = tokens(V, (2, 17))
    assert_logits_close(our_logits(model, idx), hf_logits(hf, idx))
    # The loss is over the real vocabulary: zero padding rows would otherwise add logits of 0 to the softmax.
    with torch.no_grad():
        theirs = hf(idx, labels=idx).loss  # transformers shifts the labels itself
        x, y = idx[:, :-1], idx[:, 1:]
        plain = model(x, y)[1]
        with_logits = model(x, y, return_logits=True)[1]
        monkeypatch.setitem(model_module.LOSS_CHUNK_ELEMENTS, "cpu", 8 * model.config.padded_vocab_size)
        chunked = model(x, y)[1]  # 32 rows in chunks of 8
    for loss in (plain, with_logits, chunked):
        torch.testing.assert_close(loss, theirs, rtol=1e-5, atol=1e-6)
    x.requires_grad_(False)
    loss = model.train()(x, y)[1]  # the chunked path with gradients: the padding rows get none
    loss.backward()
    assert wte.grad[:V].any() and not wte.grad[V:].any()

    # The export drops the padding: every tensor is bit for bit the one the Hugging Face folder holds.
    export_hf(model, tmp_path / "export")
    original, exported = load_file(folder / "model.safetensors"), load_file(tmp_path / "export" / "model.safetensors")
    assert exported.keys() == original.keys() - {"lm_head.weight"}
    for key, tensor in exported.items():
        assert torch.equal(tensor, original[key]), key


# ----------------------------------------------------------------------------- exporting (export.py)


def test_export_loads_in_transformers(tmp_path, hf_folder):
    folder, hf = hf_folder
    model = load_pretrained(str(folder), dropout=0.1)
    result = export_hf(model, tmp_path / "export")
    assert {"config.json", "model.safetensors"} <= set(result.files) and result.notice  # no tokenizer named
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    assert config["n_positions"] == config["n_ctx"] == 32 and config["resid_pdrop"] == 0.1

    exported = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    idx = tokens(97)
    assert_logits_close(hf_logits(exported, idx), our_logits(model.eval(), idx))


def test_load_export_load_is_identity(tmp_path, hf_folder):
    folder, _ = hf_folder
    first = load_pretrained(str(folder))
    export_hf(first, tmp_path / "export")
    second = load_pretrained(str(tmp_path / "export"))
    assert first.config == second.config
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_export_drops_vocab_padding(tmp_path):
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(block_size=16, vocab_size=100, n_layer=1, n_head=2, n_embd=16, vocab_multiple=64)
    ).eval()
    assert model.transformer.wte.weight.shape[0] == 128
    export_hf(model, tmp_path / "export")

    from safetensors import safe_open

    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as f:
        assert f.get_slice("transformer.wte.weight").get_shape() == [100, 16]
        assert "lm_head.weight" not in f.keys()
    assert json.loads((tmp_path / "export" / "config.json").read_text())["vocab_size"] == 100
    exported = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    idx = tokens(100)
    assert_logits_close(hf_logits(exported, idx), our_logits(model, idx))


def test_export_model_without_biases(tmp_path):
    """HF's GPT-2 always has biases; zeros compute what a bias-free model computes."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=16, bias=False)).eval()
    export_hf(model, tmp_path / "export")
    exported = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    idx = tokens(50)
    assert_logits_close(hf_logits(exported, idx), our_logits(model, idx))


@pytest.fixture
def gpt2_encoding():
    tiktoken = pytest.importorskip("tiktoken")
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception:
        pytest.skip("tiktoken's gpt2 files are not available offline (set TIKTOKEN_CACHE_DIR)")


def test_export_gpt2_tokenizer_matches_tiktoken(tmp_path, gpt2_encoding):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=8)).eval()
    meta = {"tokenizer": {"kind": "tiktoken", "name": "gpt2"}, "vocab_size": 50257, "eot_id": 50256}
    result = export_hf(model, tmp_path / "export", meta)
    assert result.has_tokenizer and result.notice is None
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
        assert name in result.files and (tmp_path / "export" / name).is_file()
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == 50256

    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    texts = [
        "Hello world! It's a test, isn't it?",
        "  two leading spaces\n\nnewlines\tand tabs   trailing  ",
        "ünïcödé, 中文, emoji 🤖 and numbers 3.14159 / 2024",
        "First Citizen:\nBefore we proceed any further, hear me speak.<|endoftext|>All:\nSpeak, speak.",
    ]
    for text in texts:
        assert tok.encode(text) == gpt2_encoding.encode(text, allowed_special="all"), text
    assert tok.decode(gpt2_encoding.encode(texts[2])) == texts[2]


def test_export_refuses_gpt2_meta_for_a_smaller_vocab(tmp_path):
    model = GPT(GPTConfig(block_size=8, vocab_size=65, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(HFGPT2Error, match="vocab_size is 65, smaller than its tokenizer's 50257"):
        export_hf(model, tmp_path / "export", {"kind": "tiktoken", "name": "gpt2"})
    assert not (tmp_path / "export").exists()


def test_export_char_model(tmp_path, tiny_model):
    chars = [chr(c) for c in range(32, 32 + 67)]
    meta = {"tokenizer": {"kind": "char", "chars": chars}, "vocab_size": 67, "eot_id": None}
    result = export_hf(tiny_model, tmp_path / "export", meta)
    assert result.notice is None and result.has_tokenizer and not (tmp_path / "export" / "vocab.json").exists()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")  # a character tokenizer: exact ids
    assert tok.encode("ABC !ab") == [chars.index(c) for c in "ABC !ab"]
    assert json.loads((tmp_path / "export" / "config.json").read_text())["eos_token_id"] is None
    exported = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    idx = tokens(67)
    assert_logits_close(hf_logits(exported, idx), our_logits(tiny_model, idx))


def test_export_overwrite(tmp_path, tiny_model):
    out = tmp_path / "export"
    out.mkdir()
    (out / "vocab.json").write_text("{}")  # e.g. left by an earlier GPT-2 export
    (out / "notes.txt").write_text("mine")
    with pytest.raises(HFGPT2Error, match="not empty.*--overwrite"):
        export_hf(tiny_model, out)
    export_hf(tiny_model, out, {"kind": "char", "chars": [chr(65 + i) for i in range(67)]}, overwrite=True)
    assert not (out / "vocab.json").exists()  # stale tokenizer files would describe the wrong vocabulary
    assert (out / "notes.txt").read_text() == "mine"  # files that are not ours are left alone
    assert (out / "tokenizer.json").is_file()


def test_failed_overwrite_leaves_the_old_export(tmp_path, tiny_model, monkeypatch):
    import safetensors.torch

    out = tmp_path / "export"
    export_hf(tiny_model, out, {"kind": "char", "chars": [chr(65 + i) for i in range(67)]})
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    torch.manual_seed(1)
    other = GPT(tiny_model.config)
    with pytest.raises(OSError, match="No space"):
        export_hf(other, out, None, overwrite=True)  # would also drop tokenizer.json
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # the temporary folder is gone


# ----------------------------------------------------------------------------- the export.py script


def test_export_cli(tmp_path, tiny_model, tiny_config, capsys):
    meta = {
        "tokenizer": {"kind": "char", "chars": [chr(65 + i) for i in range(67)]},
        "vocab_size": 67,
        "eot_id": 0,
    }
    ckpt = {
        "format": 1,
        "model_config": tiny_config.to_dict(),
        "model": tiny_model.state_dict(),
        "tokenizer": meta,
        "step": 0,
    }
    save_checkpoint(ckpt, tmp_path / "out" / "best.pt")
    dest = tmp_path / "hf"

    export_main(["--ckpt", str(tmp_path / "out"), "--to", str(dest)])  # an out_dir: best.pt is found
    printed = capsys.readouterr().out
    assert "model.safetensors" in printed and "tokenizer.json" in printed and "note:" not in printed
    assert f"AutoTokenizer.from_pretrained({str(dest)!r})" in printed
    exported = transformers.GPT2LMHeadModel.from_pretrained(dest).eval()
    assert exported.config.eos_token_id is None  # a char vocabulary without <|endoftext|>: none
    idx = tokens(67)
    assert_logits_close(hf_logits(exported, idx), our_logits(tiny_model, idx))

    with pytest.raises(SystemExit) as e:
        export_main(["--ckpt", str(tmp_path / "out" / "best.pt"), "--to", str(dest)])
    assert str(e.value.code).startswith("error: ") and "not empty" in str(e.value.code)
    assert "--overwrite" in str(e.value.code)
    export_main(["--ckpt", str(tmp_path / "out" / "best.pt"), "--to", str(dest), "--overwrite"])
    assert "exported" in capsys.readouterr().out

    with pytest.raises(SystemExit) as e:
        export_main(["--ckpt", str(tmp_path / "missing"), "--to", str(tmp_path / "other")])
    assert str(e.value.code).startswith("error: checkpoint") and "\n" not in str(e.value.code)

    with pytest.raises(SystemExit) as e:  # an OSError while writing: one line, not a traceback
        export_main(["--ckpt", str(tmp_path / "out"), "--to", "/dev/null/x"])
    assert str(e.value.code).startswith("error: cannot write /dev/null/x") and "\n" not in str(e.value.code)


def test_export_cli_one_line_errors(tmp_path, tiny_model, tiny_config):
    def error_of(*argv):
        with pytest.raises(SystemExit) as e:
            export_main(list(argv))
        message = str(e.value.code)
        assert message.startswith("error: ") and "\n" not in message, message
        return message

    assert "--to" in error_of("--ckpt", str(tmp_path))  # a bad command line: exit code 1, one line
    state = {k: v for k, v in tiny_model.state_dict().items() if k != "transformer.ln_f.bias"}
    ckpt = {"format": 1, "model_config": tiny_config.to_dict(), "model": state, "step": 0}
    save_checkpoint(ckpt, tmp_path / "out" / "last.pt")
    message = error_of("--ckpt", str(tmp_path / "out"), "--to", str(tmp_path / "hf"))
    assert "weights do not fit its model_config" in message
    save_checkpoint({**ckpt, "model": tiny_model.state_dict(), "tokenizer": ["a"]}, tmp_path / "out" / "last.pt")
    message = error_of("--ckpt", str(tmp_path / "out"), "--to", str(tmp_path / "hf"))
    assert "tokenizer entry is a list" in message
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- nanoGPT's Python API


def test_gpt_from_pretrained_is_nanogpts_loader(hf_folder):
    folder, _ = hf_folder
    ours = GPT.from_pretrained(str(folder))
    reference = load_pretrained(str(folder))
    assert ours.training  # a new nn.Module, as nanoGPT returns it
    assert ours.config == reference.config
    assert ours.state_dict().keys() == reference.state_dict().keys()
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in ours.state_dict().items())
    assert GPT.from_pretrained(str(folder), dict(dropout=0.1)).config.dropout == 0.1
    with pytest.raises(HFGPT2Error, match="override_args may hold only dropout .* got n_layer"):
        GPT.from_pretrained(str(folder), dict(n_layer=2, dropout=0.1))


def nanogpt_greedy(model: GPT, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """nanoGPT's decoding loop, greedy: each token from a full forward over the last block_size tokens."""
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(idx[:, -model.config.block_size :])[0][:, -1]
            idx = torch.cat([idx, logits.argmax(dim=-1, keepdim=True)], dim=1)
    return idx


def test_model_generate_is_nanogpts_sampler(tiny_model, tiny_config):
    prompt = tokens(tiny_config.vocab_size, (2, 5))
    n = 40  # past block_size (32): nanoGPT's window slides one token at a time
    expected = nanogpt_greedy(tiny_model, prompt, n)
    assert torch.equal(tiny_model.generate(prompt, n, top_k=1), expected)
    assert torch.equal(tiny_model.generate(prompt, n, temperature=0), expected)  # 0 is greedy, not a 1/0

    tiny_model.train()
    torch.manual_seed(0)
    drawn = tiny_model.generate(prompt, n, temperature=0.8, top_k=5)
    assert drawn.shape == (2, 5 + n) and torch.equal(drawn[:, :5], prompt) and tiny_model.training
    torch.manual_seed(0)  # the same draws as gptkit.generate's, from torch's global generator
    options = SamplingOptions(temperature=0.8, top_k=5, window_shift=1)
    assert torch.equal(drawn, generate(tiny_model, prompt, n, options))


def test_importing_model_imports_nothing_of_the_project():
    import subprocess
    import sys
    from pathlib import Path

    check = ("import sys, model; bad = [m for m in sys.modules if m.split('.')[0] == 'gptkit']; "
             "assert not bad, bad")
    repo = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", check], cwd=repo, check=True)
