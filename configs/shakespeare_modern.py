"""configs/shakespeare.py with the modern recipe: the modern block trained with Muon, on one GPU.

    python train.py configs/shakespeare_modern.py        then    python sample.py --ckpt out-modern/

The baby GPT's shape (6 layers, 6 heads, 384 wide, context 256) with arch = "modern" (RoPE, RMSNorm, QK-norm,
ReLU², an untied zero-init head, zero-init projections, logit soft-capping), Muon for the blocks' matrices
(AdamW for the rest) and a warmup-stable-decay schedule, in 2,000 steps instead of 5,000. Not yet measured
on a GPU (BENCHMARKS.md has the command); its CPU counterpart, configs/shakespeare_cpu_modern.py, reaches
shakespeare_cpu.py's loss in well under half the time.
"""

out_dir = "out-modern"
dataset = "shakespeare_char"
eval_interval = 250
eval_iters = 200
log_interval = 10
always_save_checkpoint = False

batch_size = 64
block_size = 256
gradient_accumulation_steps = 1

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2  # the corpus is small: the model still overfits it
arch = "modern"

optimizer = "muon"
muon_lr = 0.02
muon_momentum = 0.95
learning_rate = 3e-3  # AdamW: the embeddings and the head
beta2 = 0.99
weight_decay = 0.0
max_iters = 2000
lr_schedule = "wsd"
cooldown_frac = 0.5
warmup_iters = 0
lr_decay_iters = max_iters
min_lr = 0.0
