"""A small character-level Shakespeare model that trains on a laptop or a 2-core CPU in a few minutes.

    python prepare/shakespeare_char.py   (or let train.py do it)
    python train.py configs/shakespeare_cpu.py        then    python sample.py --ckpt out/

4 layers, 4 heads, 128 wide, context 64 (0.8M parameters); reaches val loss ~1.80 in ~2.5 minutes on
2 cores (see BENCHMARKS.md).
"""

out_dir = "out"
dataset = "shakespeare_char"
device = "cpu"
compile = False

eval_interval = 250
eval_iters = 50  # 50 x 12 x 64 = 38K tokens: a val estimate steady to ~0.01
log_interval = 25
always_save_checkpoint = False

batch_size = 12
block_size = 64
gradient_accumulation_steps = 1

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
bias = False

learning_rate = 1e-3
max_iters = 3000
lr_decay_iters = max_iters
min_lr = learning_rate / 10
beta2 = 0.99
warmup_iters = 100
