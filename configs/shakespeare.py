"""The classic baby GPT: character-level tiny Shakespeare on one GPU.

    python train.py configs/shakespeare.py        then    python sample.py --ckpt out/

6 layers, 6 heads, 384 wide, context 256 (10.75M parameters). On one H100 it should pass val loss 1.47
well inside a minute; on a CPU use configs/shakespeare_cpu.py instead.
"""

out_dir = "out"
dataset = "shakespeare_char"  # prepared on the fly from the downloaded text if missing
eval_interval = 250  # the model overfits this small corpus: watch val loss often
eval_iters = 200
log_interval = 10
always_save_checkpoint = False  # only keep checkpoints that improved val loss

batch_size = 64
block_size = 256
gradient_accumulation_steps = 1

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2
bias = False

learning_rate = 1e-3  # a baby network can take a high learning rate
max_iters = 5000
lr_decay_iters = max_iters
min_lr = learning_rate / 10
beta2 = 0.99  # tokens per step are few, so average the second moment over a shorter horizon
warmup_iters = 100
weight_decay = 0.1
