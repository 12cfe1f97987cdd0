"""Fine-tune GPT-2 XL (1.56B parameters) on tiny Shakespeare with LoRA, on one 24 GB GPU.

    python prepare/shakespeare.py
    python train.py configs/finetune_shakespeare_lora.py
    python sample.py --ckpt out-shakespeare-lora/ --prompt "ROMEO:"
    python export.py --ckpt out-shakespeare-lora/ --to gpt2-xl-shakespeare/     # adapters merged in

Full fine-tuning of gpt2-xl with AdamW needs ~25 GB for weights, gradients and optimizer state alone. Here
the base is frozen (held in bf16 on the GPU: 3.1 GB) and only rank-8 adapters on the four projections of
every block train (9.8M parameters, 0.6%); with activation checkpointing the activations of 4 x 1024 tokens
stay near 1.5 GB. Expected peak: about 5 GB (computed in BENCHMARKS.md; to be confirmed on a GPU).
Checkpoints hold only the adapters (~120 MB with their AdamW state) and the base's name and fingerprint.
"""

init_from = "gpt2-xl"
dataset = "shakespeare"  # the GPT-2 BPE version
out_dir = "out-shakespeare-lora"

block_size = 1024
batch_size = 4
gradient_accumulation_steps = 8  # 32 sequences of 1024 tokens per step, as configs/finetune_shakespeare.py
max_iters = 60

lora_rank = 8
lora_alpha = 16.0
lora_dropout = 0.05
lora_targets = "attn.c_attn,attn.c_proj,mlp.c_fc,mlp.c_proj"
activation_checkpointing = True

learning_rate = 2e-4  # adapters start at zero and move fast: a LoRA lr is ~10x a full fine-tune's
weight_decay = 0.0
warmup_iters = 5
lr_decay_iters = max_iters
min_lr = learning_rate / 10
dropout = 0.0

eval_interval = 10
eval_iters = 20
log_interval = 1
always_save_checkpoint = False  # save only when val loss improves
