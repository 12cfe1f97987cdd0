"""Checkpoints that notice corruption: every kind this project writes (the single file, the sharded folder, a
LoRA run's adapters, the Hugging Face export) carries CRC-32C checksums, and every reader refuses one changed
byte with a one-line error that names the file and the tensor, says what to try instead, and changes nothing."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import tiny_args, train_script

import sample
from gptkit import checkpoint, checksum, lora
from gptkit.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from gptkit.hf_gpt2 import HFGPT2Error, load_pretrained
from model import GPT, GPTConfig

train = train_script()

REPO = Path(__file__).resolve().parents[1]
CHARS = sorted(set("\n !',.:;?abcdefghijklmnopqrstuvwxyz"))
META = {"tokenizer": {"kind": "char", "chars": CHARS}, "vocab_size": len(CHARS)}


def tiny_state(seed: int = 0, lora_rank: int = 0) -> tuple[dict, GPT]:
    """A checkpoint dict as train.py builds one: a tiny model after one AdamW step (optimizer state)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=16, vocab_size=len(CHARS), n_layer=2, n_head=2, n_embd=32))
    if lora_rank:
        lora.apply(model, lora.LoRASettings(lora_rank, 16.0, 0.0, "attn.c_attn"))
        for name, p in model.named_parameters():  # trained adapters: B is no longer zero
            if "lora" in name:
                p.data.normal_()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    for p in model.parameters():
        p.grad = torch.randn_like(p) if p.requires_grad else None
    optimizer.step()
    weights = lora.adapter_state_dict(model) if lora_rank else model.state_dict()
    state = {"format": 1, "model_config": model.config.to_dict(), "model": weights,
             "optimizer": optimizer.state_dict(), "tokenizer": META, "step": 5, "best_val_loss": 2.5,
             "config": {"seed": 1337}}
    return state, model


def digest(path: Path) -> str:
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return hashlib.sha256(b"".join(p.read_bytes() for p in files if p.is_file())).hexdigest()


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def offset_of(path: Path, tensor: torch.Tensor) -> int:
    """Where a tensor's bytes start in a file (random floats: found once)."""
    needle = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()[:64]
    found = path.read_bytes().find(needle)
    assert found >= 0
    return found + 13


def refused(path: Path, match: str, mmap: bool = True) -> str:
    before = digest(path)
    with pytest.raises(CheckpointError, match=match) as e:
        load_checkpoint(path, mmap=mmap)
    assert digest(path) == before  # nothing on disk changed
    message = str(e.value)
    assert "\n" not in message and "is corrupt" in message
    return message


# ----------------------------------------------------------------------------- the single file


def test_a_clean_round_trip_is_bit_exact_and_says_nothing(tmp_path, capsys):
    state, _ = tiny_state()
    save_checkpoint(state, tmp_path / "last.pt")
    for mmap in (True, False):
        loaded = load_checkpoint(tmp_path / "last.pt", mmap=mmap)
        assert checksum.KEY not in loaded and loaded["step"] == 5 and loaded["best_val_loss"] == 2.5
        saved = dict(checksum.tensors(state))
        got = dict(checksum.tensors(loaded))
        assert saved.keys() == got.keys()
        for k, t in saved.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
        # the tied head shares its storage, as it was saved
        assert loaded["model"]["lm_head.weight"].data_ptr() == \
            loaded["model"]["transformer.wte.weight"].data_ptr()
    assert capsys.readouterr().err == ""


def test_a_resume_load_holds_its_tensors_in_memory_not_in_the_file(tmp_path):
    """mmap=False maps the file and copies each tensor while checking it (one read): what it returns must not
    be tied to the file, which the run's next save replaces."""
    state, _ = tiny_state()
    path = tmp_path / "last.pt"
    save_checkpoint(state, path)
    loaded = load_checkpoint(path, mmap=False)
    with open(path, "r+b") as f:  # the same file, its bytes overwritten in place
        f.write(bytes(path.stat().st_size))
    for k, t in checksum.tensors(state):
        assert torch.equal(dict(checksum.tensors(loaded))[k], t), k


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_one_flipped_byte_in_a_weight_or_an_optimizer_state_names_the_tensor(tmp_path, lora_rank):
    state, _ = tiny_state(lora_rank=lora_rank)
    save_checkpoint(state, tmp_path / "best.pt")
    weight = "transformer.h.1.attn.c_attn.lora_B" if lora_rank else "transformer.h.1.mlp.c_fc.weight"
    cases = [(state["model"][weight], f"tensor model/{weight} does not match"),
             (state["optimizer"]["state"][3]["exp_avg_sq"], "tensor optimizer/state/3/exp_avg_sq does not match")]
    for tensor, match in cases:
        path = tmp_path / "last.pt"
        save_checkpoint(state, path)
        flip(path, offset_of(path, tensor))
        message = refused(path, match, mmap=False)
        assert str(path) in message and f"try {tmp_path / 'best.pt'} instead" in message
        assert "--init_from=resume" in message  # how to resume from best.pt instead
    # sampling reads (and checks) the weights only: a damaged optimizer state does not change its model
    assert load_checkpoint(path, mmap=True)["step"] == 5


def test_a_flipped_byte_in_the_metadata_is_a_one_line_error(tmp_path):
    state, _ = tiny_state()
    path = tmp_path / "last.pt"
    for needle in (b"best_val_loss", b"seed", b"model_config", b"tokenizer"):
        save_checkpoint(state, path)
        flip(path, path.read_bytes().index(needle) + 1)
        message = refused(path, "its metadata", mmap=False)
        assert "restore it from a copy" in message  # nothing else in the folder


def test_the_metadata_checksum_catches_what_the_zip_crc_cannot(tmp_path, monkeypatch):
    """torch can be told not to write the zip's CRCs (set_crc32_options): the checksum of the settings
    still notices a changed value."""
    state, _ = tiny_state()
    save_checkpoint(state, tmp_path / "last.pt")
    loaded = torch.load(tmp_path / "last.pt", weights_only=True)
    loaded["best_val_loss"] = 2.4  # as a changed byte in the pickled float would
    torch.save(loaded, tmp_path / "edited.pt")
    refused(tmp_path / "edited.pt", "its metadata")


def test_a_checkpoint_without_checksums_loads_with_a_note(tmp_path, capsys):
    state, _ = tiny_state()
    torch.save(state, tmp_path / "old.pt")  # as save_checkpoint wrote before checksums
    assert load_checkpoint(tmp_path / "old.pt")["step"] == 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "carries no checksums" in err


def test_truncated_and_random_files_are_one_line_errors_without_torchs_text(tmp_path):
    state, _ = tiny_state()
    path = tmp_path / "last.pt"
    save_checkpoint(state, path)
    data = path.read_bytes()
    rng = random.Random(0)
    for cut in (len(data) // 2, len(data) - 10, 100):
        path.write_bytes(data[:cut])
        message = refused(path, "not a complete checkpoint file")
        assert "mmap" not in message and "miniz" not in message and "Errno" not in message
    path.write_bytes(rng.randbytes(len(data)))
    refused(path, "not a complete checkpoint file")


def test_a_set_in_the_config_loads_under_another_hash_seed(tmp_path):
    """A set's order follows PYTHONHASHSEED: the metadata's checksum must not. Saved in one process, loaded in
    others with other seeds."""
    code = """
import sys, torch
from gptkit.checkpoint import load_checkpoint, save_checkpoint
path = sys.argv[2]
tags = {f"tag{i}" for i in range(40)}
if sys.argv[1] == "save":
    save_checkpoint({"format": 1, "model_config": {}, "model": {"w": torch.ones(3)}, "config": {"tags": tags}}, path)
else:
    assert load_checkpoint(path)["config"]["tags"] == tags
"""
    path = tmp_path / "last.pt"
    for i, seed in enumerate(("1", "2")):  # (40 strings: their set's order differs between the two seeds)
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        subprocess.run([sys.executable, "-c", code, "load" if i else "save", str(path)], env=env, check=True,
                       cwd=REPO)


def test_the_structure_checksum_is_repr_without_sets():
    """Checkpoints saved before the canonical encoding hashed repr(): for everything but sets it is the same."""
    state, _ = tiny_state()
    state["config"] = {"x": (1,), "y": [1.5, None, True], "z": ("a", 2), "e": ()}
    skeleton = checksum._skeleton(state)
    assert checksum.canonical(skeleton) == repr(skeleton)
    assert checksum.canonical({"s": {3, 1, 2}, "f": frozenset(), "t": set()}) == \
        "{'s': {1, 2, 3}, 'f': frozenset(), 't': set()}"


def test_a_damaged_optimizer_state_is_a_note_to_readers_of_the_weights_and_dropped(tmp_path, capsys):
    """A memory-mapped load (sample, export) verifies the optimizer state too: damage there is a note, and the
    state is left out of the dict so that a later save cannot stamp it with fresh checksums; resume refuses it."""
    state, _ = tiny_state()
    path = tmp_path / "last.pt"
    save_checkpoint(state, path)
    flip(path, offset_of(path, state["optimizer"]["state"][1]["exp_avg"]))
    loaded = load_checkpoint(path)  # mmap: what sample.py and export.py do
    assert "optimizer" not in loaded and torch.equal(loaded["model"]["lm_head.weight"], state["model"]["lm_head.weight"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path} is damaged in its optimizer state (tensor optimizer/state/1/exp_avg" in err
    assert "resuming from it will be refused" in err
    save_checkpoint(loaded, tmp_path / "again.pt")  # what export.py --format pt does: no optimizer to stamp
    assert "optimizer" not in load_checkpoint(tmp_path / "again.pt", mmap=False)
    refused(path, "tensor optimizer/state/1/exp_avg does not match", mmap=False)


def test_sample_and_export_note_a_damaged_optimizer_state(tmp_path, capsys):
    import export

    state, _ = tiny_state()
    path = tmp_path / "out" / "last.pt"
    save_checkpoint(state, path)
    flip(path, offset_of(path, state["optimizer"]["state"][2]["exp_avg_sq"]))
    sample.main(["--device=cpu", f"--ckpt={path}", "--max_new_tokens=4", "--num_samples=1"])
    export.main([f"--ckpt={path}", "--format=pt", f"--out={tmp_path / 'exported.pt'}"])
    notes = [line for line in capsys.readouterr().err.splitlines() if "is damaged in its optimizer state" in line]
    assert len(notes) == 2 and all("resuming from it will be refused" in line for line in notes)


def test_a_file_that_is_not_a_checkpoint_is_named_as_such(tmp_path):
    """sample.py --ckpt out/config.json: not a corrupt checkpoint, but no checkpoint at all."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"n_layer": 4}\n')
    (out / "notes.txt").write_text("trained on a Tuesday\n")
    (out / "model.safetensors").write_bytes((16).to_bytes(8, "little") + b'{"__metadata__":{}}')
    for name, what in [("config.json", "a JSON file"), ("notes.txt", "a text file"),
                       ("model.safetensors", "a safetensors file")]:
        with pytest.raises(SystemExit) as e:
            sample.main(["--device=cpu", f"--ckpt={out / name}", "--max_new_tokens=4"])
        message = str(e.value.code)
        assert message.startswith(f"error: {out / name} is not a checkpoint ({what}") and "corrupt" not in message
        assert f"pass the run's folder ({out}/)" in message and "\n" not in message


def test_a_config_file_given_as_a_checkpoint_points_at_its_runs_out_dir(tmp_path, monkeypatch):
    """sample.py --ckpt configs/shakespeare_cpu.py: the folder to pass is the config's out_dir, not configs/."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    config = Path("configs") / "shakespeare_cpu.py"
    config.write_text((REPO / config).read_text())  # its out_dir is "out"

    def message() -> str:
        with pytest.raises(SystemExit) as e:
            sample.main(["--device=cpu", f"--ckpt={config}", "--max_new_tokens=4"])
        assert isinstance(e.value.code, str) and "\n" not in e.value.code
        return e.value.code

    assert message() == (f"error: {config} is a config file, not a checkpoint; pass its run's out_dir (out/, which "
                         f"holds no checkpoint yet: python train.py {config} writes one)")
    state, _ = tiny_state()
    save_checkpoint(state, tmp_path / "out" / "best.pt")
    assert message() == f"error: {config} is a config file, not a checkpoint; pass its run's out_dir: out/"
    config.write_text("max_iters = 3\n")  # no out_dir of its own
    assert message().endswith("pass its run's out_dir (the folder holding best.pt or last.pt)")
    assert "configs/" not in message().split("; ")[1]


# ----------------------------------------------------------------------------- the sharded folder


def sharded(tmp_path: Path) -> tuple[Path, dict]:
    state, model = tiny_state()
    record = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.load_state_dict(state["optimizer"])
    checkpoint.save_sharded(tmp_path / "out" / "last", record, model, optimizer)
    return tmp_path / "out" / "last", state


def test_a_sharded_checkpoint_round_trips_and_notices_a_flipped_byte(tmp_path):
    folder, state = sharded(tmp_path)
    loaded = load_checkpoint(folder, mmap=False)
    for k, t in state["model"].items():
        assert torch.equal(loaded["model"][k], t), k
    shard = next(folder.glob("*.distcp"))
    clean = shard.read_bytes()
    flip(shard, offset_of(shard, state["model"]["transformer.h.0.attn.c_proj.weight"]))
    message = refused(folder, r"tensor model\.transformer\.h\.0\.attn\.c_proj\.weight@0,0 in __0_0\.distcp")
    assert "restore it from a copy" in message
    shard.write_bytes(clean)
    flip(shard, offset_of(shard, state["optimizer"]["state"][2]["exp_avg"]))
    assert load_checkpoint(folder, mmap=True)["step"] == 5  # the optimizer is not read when sampling
    refused(folder, r"tensor optimizer\.state\.", mmap=False)  # but it is on resume
    shard.write_bytes(clean)
    # a save killed between its renames leaves the previous one as last.old/: the message points at it
    (tmp_path / "out" / "last.old").mkdir()
    for p in folder.iterdir():
        (tmp_path / "out" / "last.old" / p.name).write_bytes(p.read_bytes())
    flip(folder / ".metadata", 40)
    message = refused(folder, r"\.metadata")
    assert f"try {tmp_path / 'out' / 'last.old'}/ instead" in message
    (folder / ".metadata").write_bytes((tmp_path / "out" / "last.old" / ".metadata").read_bytes())
    flip(folder / checkpoint.RECORD, (folder / checkpoint.RECORD).read_bytes().index(b"best_val_loss") + 2)
    refused(folder, "record.pt: its metadata")


# ----------------------------------------------------------------------------- the Hugging Face export


def test_the_hf_export_records_its_tensors_checksums(tmp_path, capsys):
    import export

    _, model = tiny_state()
    export.export_hf(model, tmp_path / "hf", META)
    reloaded = load_pretrained(str(tmp_path / "hf"))
    x = torch.randint(len(CHARS), (1, 8))
    assert torch.equal(reloaded(x)[0], model.eval()(x)[0]) and capsys.readouterr().err == ""
    weights = tmp_path / "hf" / "model.safetensors"
    flip(weights, offset_of(weights, model.transformer.h[1].ln_2.weight + 0))
    with pytest.raises(HFGPT2Error, match="is corrupt: tensor transformer.h.1.ln_2.weight does not match"):
        load_pretrained(str(tmp_path / "hf"))


def test_a_safetensors_file_without_checksums_loads_with_a_note(tmp_path, capsys):
    """Weights from elsewhere (save_pretrained, the Hub) carry no checksums: they load, and the user is told
    that damage to them cannot be detected; an export of this project without them says it is an old one."""
    from safetensors.torch import load_file, save_file

    import export

    _, model = tiny_state()
    export.export_hf(model, tmp_path / "hf", META)
    weights = tmp_path / "hf" / "model.safetensors"
    save_file(load_file(str(weights)), str(weights), metadata={"format": "pt"})  # the CRCs' metadata gone
    capsys.readouterr()
    load_pretrained(str(tmp_path / "hf"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "carries no checksums (exported before they were recorded)" in err
    (tmp_path / "hf" / "gptkit_tokenizer.json").unlink()  # no longer recognisable as an export of ours
    load_pretrained(str(tmp_path / "hf"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"note: {weights} carries no checksums of this project" in err


# ----------------------------------------------------------------------------- through the scripts


def tiny_run(data: Path, out: Path) -> list[str]:
    """The suite's tiny run (conftest.tiny_args), 4 steps saving at 2 and 4; returns its arguments."""
    argv = tiny_args(data, out, gradient_accumulation_steps=1, max_iters=4, eval_interval=2, eval_iters=1,
                     warmup_iters=1, lr_decay_iters=4, always_save_checkpoint=True)
    train.main(argv)
    return argv


def test_resume_refuses_a_corrupt_last_and_says_how_to_fall_back(char_dataset, tmp_path):
    out = tmp_path / "out"
    argv = tiny_run(char_dataset, out)
    last = out / "last.pt"
    with zipfile.ZipFile(last) as z:  # a byte in the middle of the last storage: the optimizer's state
        info = z.getinfo(next(n for n in reversed(z.namelist()) if "/data/" in n and z.getinfo(n).file_size > 64))
    flip(last, info.header_offset + 200)
    before = digest(out)
    with pytest.raises(SystemExit) as e:
        train.main([*argv, "--init_from=resume", "--max_iters=6"])
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message and f"{last} is corrupt" in message
    assert f"copy {out / 'best.pt'} to {last}, then --init_from=resume" in message
    assert digest(out) == before


def test_the_issue_table_every_row_is_one_line(char_dataset, tmp_path, capsys):
    """A last.pt cut at a random byte, replaced by random bytes, or with 20 random bytes flipped: sample.py
    ends with one `error:` line each time, and never samples from a changed model."""
    out = tmp_path / "out"
    tiny_run(char_dataset, out)
    (out / "best.pt").unlink()
    last = out / "last.pt"
    data = last.read_bytes()
    rng = random.Random(1)
    for _ in range(4):
        damaged = [data[: rng.randrange(len(data))], rng.randbytes(len(data))]
        flipped = bytearray(data)
        for offset in rng.sample(range(len(data)), 20):
            flipped[offset] ^= 1 << rng.randrange(8)
        for content in [*damaged, bytes(flipped)]:
            last.write_bytes(content)
            with pytest.raises(SystemExit) as e:
                sample.main(["--device=cpu", f"--ckpt={out}", "--max_new_tokens=4"])
            message = str(e.value.code)
            assert message.startswith("error: ") and "\n" not in message and "is corrupt" in message, message
    capsys.readouterr()


# ----------------------------------------------------------------------------- a damaged best.pt on resume


def no_better_evaluation(monkeypatch) -> None:
    """Every evaluation from now on scores worse than any before: the resumed run never improves."""
    monkeypatch.setattr(train, "evaluate", lambda *a, **k: (9.0, {}))


@pytest.mark.parametrize("resume", ["--init_from=resume", "--resume=auto"])
def test_a_resumed_run_sets_a_damaged_best_aside_and_says_so(char_dataset, tmp_path, monkeypatch, capsys, resume):
    """best.pt cut short, then the run resumed (from its whole last.pt) and never improving: one line says what
    was found and done, the damaged file is kept aside byte for byte, no best.pt is left for sample.py to
    take (it samples from last.pt), and the run's last line says so again."""
    out = tmp_path / "out"
    argv = tiny_run(char_dataset, out)
    best = out / "best.pt"
    best.write_bytes(best.read_bytes()[: best.stat().st_size // 2])
    damaged = best.read_bytes()
    capsys.readouterr()
    no_better_evaluation(monkeypatch)
    assert train.main([*argv, resume, "--max_iters=6", "--lr_decay_iters=6"])["step"] == 6
    lines = capsys.readouterr().out.splitlines()
    notes = [line for line in lines if "best.pt" in line and line.startswith("note:")]
    assert notes == [f"note: {best} is damaged: it is not a complete checkpoint file (cut short, or not a checkpoint "
                     f"at all); set aside as {best}.damaged; the next evaluation below its val loss "
                     f"{load_checkpoint(out / 'last.pt')['best_val_loss']:.4f} writes a new best.pt, and until then "
                     f"sample.py and the other readers of {out}/ take last.pt"]
    assert (out / "best.pt.damaged").read_bytes() == damaged and not best.exists()
    assert f"set aside as {best}.damaged; none since beat it); checkpoints in {out}/: last.pt;" in lines[-1]
    sample.main([f"--ckpt={out}", "--max_new_tokens=3", "--device=cpu", "--threads=1"])
    assert f"sample.py: {out}/last.pt (step 6)" in capsys.readouterr().err


def test_a_later_best_replaces_the_damaged_one_and_a_whole_one_is_left_alone(char_dataset, tmp_path, monkeypatch,
                                                                             capsys):
    """A byte flipped in best.pt's weights: set aside on resume, and the first evaluation that improves writes
    a new, whole best.pt. A resume whose best.pt is whole says nothing of it and moves nothing."""
    out = tmp_path / "out"
    argv = tiny_run(char_dataset, out)
    best = out / "best.pt"
    ckpt = load_checkpoint(best)
    flip(best, offset_of(best, ckpt["model"]["transformer.h.0.mlp.c_fc.weight"]))
    capsys.readouterr()
    train.main([*argv, "--init_from=resume", "--max_iters=40", "--lr_decay_iters=40", "--eval_interval=4"])
    out_text = capsys.readouterr().out
    assert f"note: {best} is damaged: tensor model/transformer.h.0.mlp.c_fc.weight does not match the checksum " \
           f"saved with it; set aside as {best}.damaged;" in out_text
    assert "(best so far)" in out_text  # learning on: an evaluation beat the damaged one's
    assert load_checkpoint(best)["step"] > 4 and (out / "best.pt.damaged").is_file()
    before = [digest(p) for p in (best, out / "best.pt.damaged")]
    no_better_evaluation(monkeypatch)
    train.main([*argv, "--init_from=resume", "--max_iters=44", "--lr_decay_iters=44", "--eval_interval=4"])
    assert "damaged" not in capsys.readouterr().out
    assert [digest(p) for p in (best, out / "best.pt.damaged")] == before


def test_a_damaged_sharded_best_is_set_aside_whole(tmp_path, capsys):
    """A sharded best/ (a run under FSDP) is checked through its shards' checksums, without loading them, and
    set aside as a folder; an earlier one set aside stays."""
    from gptkit.checkpoint.resume import set_aside_damaged_best

    folder, state = sharded(tmp_path)
    best = folder.rename(folder.with_name("best"))
    assert set_aside_damaged_best(best.parent, 1.5) is None and capsys.readouterr().out == ""
    (best.parent / "best.damaged").mkdir()  # set aside before
    shard = next(best.glob("*.distcp"))
    flip(shard, offset_of(shard, state["model"]["transformer.h.0.attn.c_proj.weight"]))
    assert set_aside_damaged_best(best.parent, 1.5) == best.parent / "best.damaged2"
    assert capsys.readouterr().out.startswith(f"note: {best}/ is damaged: tensor model.transformer.h.0.attn.c_proj"
                                              f".weight@0,0 in __0_0.distcp does not match the checksum saved with it;"
                                              f" set aside as {best.parent / 'best.damaged2'}; the next evaluation "
                                              f"below its val loss 1.5000 writes a new best.pt")
    assert not best.exists() and (best.parent / "best.damaged").is_dir()
    assert (best.parent / "best.damaged2" / checkpoint.RECORD).is_file()  # the folder whole, only renamed
