"""configs/shakespeare_cpu.py with the modern recipe: the modern block trained with Muon, on a 2-core CPU.

    python train.py configs/shakespeare_cpu_modern.py        then    python sample.py --ckpt out-modern/

The same data and model size as shakespeare_cpu.py (4 layers, 4 heads, 128 wide, context 64), with RoPE,
RMSNorm, QK-norm, ReLU², an untied zero-init head, zero-init projections and logit soft-capping (arch =
"modern"), Muon for the blocks' matrices (AdamW for the rest) and a warmup-stable-decay schedule. It reaches
shakespeare_cpu.py's final val loss (1.80) in about a third of its wall time, and 1.56 by the time that one
ends (BENCHMARKS.md, "The modern recipe"). Muon's Newton-Schulz iteration costs the same per step whatever
the batch, so a CPU does better with fewer, bigger steps: 32 sequences a step instead of 12.
"""

out_dir = "out-modern"
dataset = "shakespeare_char"
device = "cpu"
compile = False

eval_interval = 100
eval_iters = 19  # 19 x 32 x 64 = 39K tokens, about the validation sample of shakespeare_cpu.py (38K)
log_interval = 25
always_save_checkpoint = False

batch_size = 32
block_size = 64
gradient_accumulation_steps = 1

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
arch = "modern"

optimizer = "muon"
muon_lr = 0.02
muon_momentum = 0.95
learning_rate = 3e-3  # AdamW: embeddings, head
beta2 = 0.99
weight_decay = 0.0
max_iters = 900
lr_schedule = "wsd"
cooldown_frac = 0.5
warmup_iters = 0
lr_decay_iters = max_iters
min_lr = 0.0
