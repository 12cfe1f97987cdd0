"""Preference tuning on unpaired rows (KTO): a chat model, out-chat/ from configs/finetune_chat.py, tuned on rows of
a prompt, one completion and a label (desirable or not) to raise the desirable completions' likelihood relative to
itself as it starts, and lower the undesirable ones'.

    python prepare/preference.py --input rows.jsonl --tokenizer out-chat/ --name myrows   # prompt, completion, label
    python train.py configs/kto_chat.py --dataset=myrows                   # into out-kto/; then chat.py, serve.py
    python train.py configs/kto_chat.py --dataset=myrows --lora_rank=8     # adapters; the reference: them off

batch_size counts rows (each one sequence, with its KL sequence, the row's prompt and the previous row's
completion, scored without gradients). The reference is DPO's: the starting model's log-probabilities
precomputed and saved in the checkpoints, or with --lora_rank the model with its adapters off. The log has the
loss, kl (the reference point z), the mean rewards of the desirable and undesirable rows, their
log-probabilities and auc (the share of desirable-undesirable pairs of rows ordered right); best.pt is the
lowest val loss. beta is dpo_beta (0.1, TRL's default for KTO too). The weights: the run says at its start when
weight x rows of the desirable over the undesirable is outside TRL's advised [1, 4/3]. The learning rate and
step count are a starting point for GPT-2 124M, as configs/dpo_chat.py's, not tuned here.
"""

init_from = "out-chat"  # the chat model to tune: configs/finetune_chat.py's out_dir
dataset = "myrows"  # prepare/preference.py --name myrows --tokenizer out-chat/ on prompt, completion, label rows
out_dir = "out-kto"

objective = "kto"
dpo_beta = 0.1
kto_desirable_weight = 1.0
kto_undesirable_weight = 1.0

block_size = 1024  # at most; a run uses the longest row's (or KL sequence's) length when that is less
batch_size = 8  # rows per micro-batch (+ their 8 KL sequences, without gradients)
gradient_accumulation_steps = 4  # 32 rows per step
max_iters = 200

learning_rate = 5e-6
warmup_iters = 20
lr_decay_iters = max_iters
min_lr = learning_rate / 10
weight_decay = 0.0
dropout = 0.0  # the reference is scored without dropout: so is the tuned model
lora_dropout = 0.0

eval_interval = 50
eval_iters = 13  # 13 x 8 = the first 104 val rows
log_interval = 10
always_save_checkpoint = False  # keep only improved checkpoints: chat.py and serve.py read best.pt
