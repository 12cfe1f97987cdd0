#!/bin/bash
# The second call of 2026-11-28 on the H200 (its output: rerun.log), as it ran from shared/ in the checkout: the
# compiled-dropout probe (then tests/test_zz_diag_cuda.py), ours with --cuda_graphs=True (stopped at 50 s by a
# limit set too short), nanoGPT to step 1,750.
stamp() { python3 -u -c "import sys,time;t=time.time()
for l in sys.stdin: print(f'{time.time()-t:7.1f} {l}', end='', flush=True)"; }
cd "$(dirname "$0")/.." || exit 1
timeout 95 python3 -m pytest -s -q -p no:cacheprovider -m cuda tests/test_zz_diag_cuda.py 2>&1 | grep -E "DIAG|passed|failed|Error" | tee $OUT/diag.log
mkdir -p /tmp/d /tmp/n && python3 prepare/shakespeare_char.py --out_dir=/tmp/d/shakespeare_char --input=shared/data/tinyshakespeare.txt > /dev/null
timeout 50 python3 train.py configs/shakespeare.py --data_root=/tmp/d --out_dir=/tmp/o --overwrite=True --cuda_graphs=True --max_iters=1750 2>&1 | stamp | grep -v "^ *[0-9.]* *  [a-z_0-9]* *=" > $OUT/ours_graphed.log
grep -E "val loss|ms/step" $OUT/ours_graphed.log | tail -4
cp -r shared/anchors/nanoGPT/. /tmp/n/ && cp shared/data/tinyshakespeare.txt /tmp/n/data/shakespeare_char/input.txt
(cd /tmp/n && PYTHONPATH= python3 -c "import runpy,sys,types
sys.modules.setdefault('requests', types.ModuleType('requests'))
runpy.run_path('data/shakespeare_char/prepare.py', run_name='__main__')" > /dev/null && \
 PYTHONPATH= timeout 110 python3 train.py config/train_shakespeare_char.py --max_iters=1750 2>&1 | stamp > $OUT/nanogpt_train.log)
grep -E "val loss" $OUT/nanogpt_train.log | tail -8
