"""Checkpoints: what a run saves, and every way it is read back. One module per topic:

    layout.py      where a run's checkpoints are (best.pt, last.pt, a sharded best/ or last/, nanoGPT's ckpt.pt)
    damage.py      what is wrong with one: checksums checked, the zip container inspected, every message about it
    file.py        the checkpoint dict, saved atomically with its checksums, loaded safely in any of its forms
    sharded.py     the sharded folder of a run under FSDP (torch.distributed.checkpoint), with its checksums
    models.py      the model a checkpoint holds, a fine-tuning base, and a model with its tokenizer (load_model)
    background.py  saves that write from a background thread (train.py --async_save)
    resume.py      what a training run continues from (--init_from=resume, --resume=auto), checked as its own
    run_model.py   the model a training run trains: from scratch, resumed, or a fine-tune's base (LoRA included)

The names the scripts use are importable from here: `from gptkit.checkpoint import load_checkpoint`; train.py's own
(resume.py, run_model.py) from their modules.
"""

from gptkit.checkpoint.damage import CorruptCheckpointError
from gptkit.checkpoint.file import (
    FORMAT_VERSION,
    RESUME_KEYS,
    build_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from gptkit.checkpoint.layout import (
    RECORD,
    TRAIN_HINT,
    CheckpointError,
    find_checkpoint,
    holds_checkpoint,
    is_sharded_checkpoint,
    remove_checkpoint,
    saved_checkpoint,
)
from gptkit.checkpoint.models import (
    GPT2_BPE,
    load_base_model,
    load_model,
    load_model_and_settings,
    lora_base,
    lora_model,
    model_from_checkpoint,
)
from gptkit.checkpoint.sharded import load_sharded_optimizer, load_whole_optimizer, save_sharded

__all__ = [
    "FORMAT_VERSION", "GPT2_BPE", "RECORD", "RESUME_KEYS", "TRAIN_HINT", "CheckpointError", "CorruptCheckpointError",
    "build_checkpoint", "find_checkpoint", "holds_checkpoint", "is_sharded_checkpoint", "load_base_model",
    "load_checkpoint", "load_model", "load_model_and_settings", "load_sharded_optimizer", "load_whole_optimizer",
    "lora_base", "lora_model", "model_from_checkpoint", "remove_checkpoint", "save_checkpoint", "save_sharded",
    "saved_checkpoint",
]
