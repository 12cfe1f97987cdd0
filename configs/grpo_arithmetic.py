"""The recipe's second stage (README.md "Learning from a checker"): GRPO from the fine-tuned model, learning
from tasks/arithmetic.py's checker alone, the held-out greedy accuracy logged at each evaluation (val_reward).

    python train.py configs/grpo_arithmetic.py
    python eval.py --ckpt out-arith-grpo --task checker --pass_k 8

Each step: 8 prompts x grpo_n=16 replies drawn by the serving engine from the current weights, rewarded 1 or 0,
the clipped policy-gradient loss on the reply tokens. Its held-out accuracy by step is in BENCHMARKS.md.
"""

objective = "grpo"
init_from = "out-arith-sft"
dataset = "arithmetic"  # (its tokenizer: GRPO reads no tokens of it)
out_dir = "out-arith-grpo"
device = "cpu"
compile = False

grpo_task = "tasks/arithmetic.py"
grpo_n = 16  # (8 climbed more slowly from the same start: BENCHMARKS.md, "Learning from a checker")
grpo_max_tokens = 6  # the longest sum has 4 digits, then the newline
grpo_temperature = 1.0
grpo_clip = 0.2
grpo_kl = 0.0
grpo_eval_prompts = 200

batch_size = 128  # replies: 8 prompts x 16
gradient_accumulation_steps = 1
max_iters = 500
learning_rate = 1e-4
decay_lr = True  # down to min_lr at the last step: held constant, the last evaluations wander by a few points
warmup_iters = 0
lr_decay_iters = 500
min_lr = 1e-5
dropout = 0.0

eval_interval = 25
log_interval = 5
always_save_checkpoint = False
