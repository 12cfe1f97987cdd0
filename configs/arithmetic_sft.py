"""The recipe's first stage (README.md "Learning from a checker"): a small character-level model trained from
scratch on worked additions (tasks/arithmetic.py's training side), stopped while it is still often wrong, so
that GRPO has something to learn from reward alone.

    python tasks/arithmetic.py 100000 data/arithmetic.txt
    python prepare/text.py --input data/arithmetic.txt --name arithmetic --tokenizer char
    python train.py configs/arithmetic_sft.py
    python eval.py --ckpt out-arith-sft --task checker --pass_k 8       # held-out greedy accuracy and pass@8

Its held-out accuracy at this length, and at others, is in BENCHMARKS.md ("Learning from a checker"). Most of
what it gets wrong is not the sum but where the prompt sits: its training windows start anywhere in the text,
so it has always seen a problem after the one before, while eval.py and GRPO put the prompt at the very start
of the context. GRPO learns that first, then the carries.
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
max_iters = 4000  # stopped two thirds down the schedule below: still often wrong, as the recipe wants
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 50
lr_decay_iters = 6000
beta2 = 0.99

eval_interval = 500
eval_iters = 20
log_interval = 100
