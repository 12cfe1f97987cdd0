"""Fine-tune OpenAI's GPT-2 (124M) on tiny Shakespeare, tokenized with the GPT-2 BPE.

    python train.py configs/finetune_shakespeare.py
    python train.py configs/finetune_shakespeare.py --init_from=gpt2-xl   # a bigger model: only this changes

A few minutes on one GPU: 20 steps of 32 x 1024 tokens, about two passes over the ~300K-token training split.
Fine-tuning moves the weights only a little: a small constant learning rate, dropout on, and a checkpoint only
when the validation loss improves (the data is small, so the model soon starts to overfit).
"""

init_from = "gpt2"
dataset = "shakespeare"  # the GPT-2 BPE version (not the character-level one)
out_dir = "out-shakespeare"

# One 1024-token sequence per micro-batch keeps memory low (the larger GPT-2s need that); 32 make one step.
block_size = 1024
batch_size = 1
gradient_accumulation_steps = 32
max_iters = 20

learning_rate = 3e-5
decay_lr = False  # constant: too few steps for warmup and decay to matter
# Only used with --decay_lr=True: a short warmup, then a cosine down to a tenth by the last step.
warmup_iters = 2
lr_decay_iters = max_iters
min_lr = learning_rate / 10
dropout = 0.1

eval_interval = 5
eval_iters = 20
log_interval = 1
always_save_checkpoint = False  # save only when val loss improves
