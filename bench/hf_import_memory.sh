#!/usr/bin/env bash
# Peak resident memory of the largest rank for one training step of a ~250M-parameter Llama imported
# from a Hugging Face folder, at W=1 and W=4, float32 on CPU. Full sharding should bring W=4 well under
# half of W=1: each rank keeps 16 B/W per parameter plus one or two gathered units.
#   bash bench/hf_import_memory.sh [WORK_DIR]
# GNU time's "Maximum resident set size" for torchrun is the largest of its processes (getrusage of
# children is a maximum, not a sum); train.py's mem_gb is rank 0's own peak RSS.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-/tmp/hf_import_memory}
mkdir -p "$WORK"
if [ ! -f "$WORK/hf/config.json" ]; then
  python3 - "$WORK/hf" <<'PY'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
                  num_key_value_heads=4, intermediate_size=4096, max_position_embeddings=2048,
                  rope_theta=500000.0, tie_word_embeddings=False)
model = LlamaForCausalLM(cfg).float()
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", file=sys.stderr)
model.save_pretrained(sys.argv[1], max_shard_size="400MB")
PY
fi
python3 -c "import numpy as np; np.save('$WORK/tokens.npy', np.random.default_rng(0).integers(0, 32000, 100000).astype(np.uint16))"
for W in 1 4; do  # --steps 0: only the import (each rank reads its slices), no step
  rm -rf "$WORK/imp$W"
  OMP_NUM_THREADS=1 /usr/bin/time -v python3 -m torch.distributed.run --standalone --nproc_per_node $W train.py \
    --init_from "$WORK/hf" --steps 0 --dtype float32 --out_dir "$WORK/imp$W" >"$WORK/implog$W" 2>&1
  rss_kib=$(awk '/Maximum resident set size/ {print $6}' "$WORK/implog$W")
  echo "W=$W  import only (--steps 0): largest process peak RSS $(python3 -c "print(f'{$rss_kib * 1024 / 2**30:.2f}')") GiB"
done
for W in 1 4; do
  rm -rf "$WORK/out$W"
  OMP_NUM_THREADS=1 /usr/bin/time -v python3 -m torch.distributed.run --standalone --nproc_per_node $W train.py \
    --init_from "$WORK/hf" --data "$WORK/tokens.npy" --steps 1 --seq_len 256 --batch_size $W --micro_batch_size 1 \
    --dtype float32 --ac selective --out_dir "$WORK/out$W" >"$WORK/log$W" 2>&1
  rss_kib=$(awk '/Maximum resident set size/ {print $6}' "$WORK/log$W")
  rank0_gb=$(python3 -c "import json; print(json.loads(open('$WORK/out$W/metrics.jsonl').readline())['mem_gb'])")
  echo "W=$W  largest process peak RSS $(python3 -c "print(f'{$rss_kib * 1024 / 2**30:.2f}')") GiB  (rank 0 mem_gb $rank0_gb)"
done
