"""GPT-2 124M's shape with the modern recipe on FineWeb, in the spirit of modded-nanogpt's speedrun.

    python prepare/fineweb.py
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m_modern.py

12 layers, 12 heads, 768 wide, context 1024, arch = "modern" (RoPE, RMSNorm, QK-norm, ReLU², an untied
zero-init head, zero-init projections, logit soft-capping), Muon for the blocks' matrices and AdamW for the
embeddings and the head, with a warmup-stable-decay schedule. The target is configs/gpt2_124m.py's val loss
3.28 after 10B tokens in about a third of the tokens: 6,000 steps of 524,288 tokens = 3.1B. The speedrun
reached it with this optimizer and block in about that many tokens; here it is not measured yet (no GPU
figure in BENCHMARKS.md).
"""

out_dir = "out-gpt2-124m-modern"
dataset = "fineweb"
eval_interval = 250
eval_iters = 80
log_interval = 10
wandb_log = False
wandb_project = "gpt2-124m"

batch_size = 32
block_size = 1024
gradient_accumulation_steps = 16

n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
arch = "modern"

optimizer = "muon"
muon_lr = 0.02
muon_momentum = 0.95
muon_weight_decay = 0.0
learning_rate = 3e-3  # AdamW: the embeddings and the head
weight_decay = 0.0
beta1 = 0.8
beta2 = 0.95
grad_clip = 1.0
max_iters = 6000
lr_schedule = "wsd"
cooldown_frac = 0.4  # the speedrun's
warmup_iters = 100
lr_decay_iters = max_iters
min_lr = 0.0
