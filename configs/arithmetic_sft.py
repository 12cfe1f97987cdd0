"""The recipe's first stage (README.md "Learning from a checker"): a small character-level model trained from
scratch on worked additions (tasks/arithmetic.py's training side), stopped while it is still often wrong, so
that GRPO has something to learn from reward alone.

    python tasks/arithmetic.py 100000 data/arithmetic.txt
    python prepare/text.py --input data/arithmetic.txt --name arithmetic --tokenizer char
    python train.py configs/arithmetic_sft.py
    python eval.py --ckpt out-arith-sft --task checker --pass_k 8       # held-out greedy accuracy and pass@8

Measured (BENCHMARKS.md, "Learning from a checker"): 3,000 steps of a 6,000-step schedule reach 38% held-out
accuracy (a whole 1,500-step run: 1%; the whole 6,000: 76%), a start GRPO takes to 78-83% in 300 steps.
"""

out_dir = "out-arith-sft"
dataset = "arithmetic"
device = "cpu"
compile = False

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
bias = False
block_size = 32  # a few problems per window (each is at most 12 characters)

batch_size = 32
gradient_accumulation_steps = 1
max_iters = 3000  # stopped halfway down the schedule below: still often wrong, as the recipe wants
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 50
lr_decay_iters = 6000
beta2 = 0.99

eval_interval = 500
eval_iters = 20
log_interval = 100
