#!/usr/bin/env bash
# Fine-tuning a gpt2-medium-shaped model (random weights written by transformers) on the CPU:
# full vs LoRA vs LoRA + activation checkpointing. Peak RSS from /usr/bin/time, step time from metrics.jsonl.
cd "$(dirname "$0")/.."
BASE=${BASE:-/tmp/gpt2-medium-random}   # written by transformers: see BENCHMARKS.md
DATA=${DATA:-/tmp/data/shakespeare}
COMMON="--init_from=$BASE --dataset=$DATA --block_size=256 --batch_size=2 --gradient_accumulation_steps=1 --max_iters=4 --eval_interval=4 --eval_iters=1 --log_interval=1 --device=cpu --compile=False --warmup_iters=1 --lr_decay_iters=4 --overwrite=True"
for variant in full lora lora_ckpt; do
  case $variant in
    full) extra="";;
    lora) extra="--lora_rank=8";;
    lora_ckpt) extra="--lora_rank=8 --activation_checkpointing=True";;
  esac
  out=/tmp/lorabench_$variant
  /usr/bin/time -v python train.py $COMMON --out_dir=$out $extra > /tmp/lorabench_$variant.log 2> /tmp/lorabench_$variant.time
  rss=$(grep "Maximum resident" /tmp/lorabench_$variant.time | awk '{print $NF}')
  python - "$out" "$variant" "$rss" <<'PY'
import json, statistics, sys, os
out, variant, rss = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
ms = [r["ms_per_step"] for r in rows if r.get("ms_per_step")]
size = os.path.getsize(f"{out}/last.pt") / 1e6
print(f"{variant}: peak RSS {rss/1024/1024:.2f} GiB | median step {statistics.median(ms):.0f} ms (steps 2-4) | last.pt {size:.1f} MB")
PY
  grep "^model:" /tmp/lorabench_$variant.log
done
