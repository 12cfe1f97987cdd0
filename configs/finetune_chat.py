"""Chat fine-tuning: OpenAI's GPT-2 (124M) on conversations, the loss on the assistant's replies only.

    python prepare/chat.py --input conversations.jsonl --name mychat
    python train.py configs/finetune_chat.py --dataset=mychat          # into out-chat/; then chat.py, serve.py
    python train.py configs/finetune_chat.py --dataset=mychat --plan   # its memory and time on your hardware

200 steps of 8 x 1024 tokens (1.6M tokens). With fewer tokens in a split than one window of block_size + 1 (a
small conversations file), the fine-tune uses the longest window the data holds, and train.py says so. Only
improved checkpoints are kept: on a small dataset the model soon starts to overfit, and chat.py and serve.py
read best.pt. A base of this project instead of GPT-2: prepare the conversations with its tokenizer
(prepare/chat.py --tokenizer out/) and add --init_from=out/.
"""

init_from = "gpt2"
dataset = "mychat"  # prepare/chat.py --name mychat
out_dir = "out-chat"

block_size = 1024  # GPT-2's context, and prepare/chat.py's default --block_size
batch_size = 8
gradient_accumulation_steps = 1
max_iters = 200

learning_rate = 1e-4
warmup_iters = 20
lr_decay_iters = max_iters
min_lr = learning_rate / 10
dropout = 0.1

eval_interval = 50
eval_iters = 10
log_interval = 10
always_save_checkpoint = False  # save only when val loss improves
