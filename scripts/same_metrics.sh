#!/usr/bin/env bash
# Train the same short run at git revision REV and in this working tree, and diff their metrics.jsonl
# (loss and grad_norm of every step, printed with repr: equal means bit for bit).
#
#   scripts/same_metrics.sh REV [key=value ...]
#
# Default run: tiny model, 8 simulated CPU devices, bfloat16 ZeRO-3, SGD without clipping, 4 steps,
# once with grad_sync=auto and once with ring; extra key=value pairs go after those.
set -euo pipefail
rev=${1:?usage: scripts/same_metrics.sh REV [key=value ...]}; shift
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
tmp=$(mktemp -d)
trap 'git -C "$here" worktree remove --force "$tmp/rev" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git -C "$here" worktree add -q --detach "$tmp/rev" "$rev"
run() {  # run SRC_DIR NAME SYNC
  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu PYTHONPATH="$1" "$py" -m trainer.cli train \
    model.preset=tiny train.batch_size=16 train.steps=4 train.dtype=bfloat16 mesh.data=8 train.zero_stage=3 \
    train.optimizer=sgd train.grad_clip=0 run.progress=false run.log_every=1 "train.grad_sync=$3" \
    "run.dir=$tmp/$2_$3" "${@:4}" >/dev/null 2>&1
  "$py" -c "import json,sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    if 'loss' in d: print(sys.argv[2], d['step'], repr(d['loss']), repr(d.get('grad_norm')))" "$tmp/$2_$3/metrics.jsonl" "$3"
}
for sync in auto ring; do
  run "$tmp/rev" rev "$sync" "$@" >> "$tmp/rev.txt"
  run "$here" head "$sync" "$@" >> "$tmp/head.txt"
done
if diff "$tmp/rev.txt" "$tmp/head.txt"; then echo "same metrics, bit for bit ($(wc -l < "$tmp/head.txt") steps)"; else exit 1; fi
