"""GPT-2 124M from scratch on FineWeb (10B-token sample), on 8 GPUs.

    python prepare/fineweb.py
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py

A step is 32 sequences x 1024 tokens x 16 micro-batches = 524,288 tokens (2 micro-batches per GPU on 8 GPUs;
16 on one). 19,073 steps are one pass over the 10B tokens. For OpenWebText use --dataset=openwebtext.
Every 250 steps it also scores HellaSwag (all 10,042 items; seconds on GPUs, by estimate; fetched before step 0):
metrics.jsonl gets hellaswag_acc_norm, which OpenAI's GPT-2 124M puts at 0.2955 (python plot.py out-gpt2-124m).
"""

out_dir = "out-gpt2-124m"
dataset = "fineweb"
eval_interval = 250
eval_iters = 80
hellaswag_interval = 250
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
bias = True

learning_rate = 6e-4
max_iters = 19073
warmup_iters = 700
lr_decay_iters = max_iters
min_lr = learning_rate / 10
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
