"""Preference tuning (DPO): a chat model, out-chat/ from configs/finetune_chat.py, tuned on pairs of a chosen and a
rejected reply to make the chosen ones more likely than the rejected ones, relative to itself as it starts.

    python prepare/preference.py --input pairs.jsonl --tokenizer out-chat/ --name mypairs
    python train.py configs/dpo_chat.py --dataset=mypairs                  # into out-dpo/; then chat.py, serve.py
    python train.py configs/dpo_chat.py --dataset=mypairs --lora_rank=8    # adapters; the reference: them off
    python eval.py --ckpt out-dpo/ --task preference --dataset mypairs --reference out-chat/

batch_size counts pairs (each two sequences, as long as the longest pair's, at most block_size). Without LoRA
the starting model's log-probabilities of every pair are computed once before the first step and saved in the
checkpoints; with --lora_rank the reference is the model with its adapters off. Both log the loss, the
implicit rewards of the chosen and rejected replies, their margin, the accuracy (margin > 0) and the replies'
log-probabilities; best.pt is the lowest val loss (the objective as trained, anchor included).

dpo_nll_weight = 0.5 (not plain DPO's 0): DPO's loss only sees the difference between a pair's replies, and
plain DPO lets both fall together. On benchmarks/dpo_rule.py's task (BENCHMARKS.md, "Preference tuning") plain
DPO reached 100% held-out accuracy while the chosen replies' log-probability fell from -1.1 to -60 nats: the
model no longer says them (35% of its chat replies followed the rule; on one seed of four it never left 50%).
With the anchor, on all four seeds: 100% within 150 steps, the chosen replies at -0.01 to -0.13 nats, 96-100%
of the chat replies by the rule. The learning rate and step count are a starting point for GPT-2 124M, not
tuned here: watch the val accuracy and the chosen log-probability in the log.
"""

init_from = "out-chat"  # the chat model to tune: configs/finetune_chat.py's out_dir
dataset = "mypairs"  # prepare/preference.py --name mypairs --tokenizer out-chat/
out_dir = "out-dpo"

objective = "dpo"
dpo_beta = 0.1
dpo_loss = "sigmoid"  # or hinge, robust, ipo, ipo_per_token (TRL's ipo), simpo, orpo: python train.py --help
dpo_label_smoothing = 0.0
dpo_nll_weight = 0.5

block_size = 1024  # at most; a run uses the longest pair's length when that is less
batch_size = 4  # pairs per micro-batch: 8 sequences
gradient_accumulation_steps = 4  # 16 pairs per step
max_iters = 200

learning_rate = 5e-6
warmup_iters = 20
lr_decay_iters = max_iters
min_lr = learning_rate / 10
weight_decay = 0.0  # (DPO's steps are small; the positions past the pairs' length get no gradient to decay)
dropout = 0.0  # the reference is scored without dropout: so is the tuned model
lora_dropout = 0.0

eval_interval = 50
eval_iters = 25  # 25 x 4 = the first 100 val pairs
log_interval = 10
always_save_checkpoint = False  # keep only improved checkpoints: chat.py and serve.py read best.pt
