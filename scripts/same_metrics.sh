#!/usr/bin/env bash
# Train the same short runs at git revision REV and in this working tree, and diff their metrics.jsonl
# (loss, grad_norm and the objective's other metrics of every step, printed with repr: equal means bit for bit).
#
#   scripts/same_metrics.sh REV [key=value ...]
#
# Every run: 8 simulated CPU devices, bfloat16, SGD without clipping, 4 steps. The cases (one line each):
#   default auto / default ring  tiny model, ZeRO-3 over mesh.data=8, train.grad_sync=auto and ring
#   MoE (2,1,4) ZeRO-3           tiny mixtral, 4 experts split over `data`, both router losses on
#   ring context 2 (2,1,2)       mesh.context=2 with train.context_attention=ring, ZeRO-3
#   DPO (8,1,1) / DPO (4,2,1)    preference pairs (made here, prepared with the working tree's `meshtrain prepare`)
#                                from the tests' tiny policy and reference (tests/fixtures/dpo), ZeRO-3, plain and 1F1B
# Extra key=value pairs go after each case's own.
set -euo pipefail
rev=${1:?usage: scripts/same_metrics.sh REV [key=value ...]}; shift
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
tmp=$(mktemp -d)
trap 'git -C "$here" worktree remove --force "$tmp/rev" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git -C "$here" worktree add -q --detach "$tmp/rev" "$rev"
export XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu

fix=$here/tests/fixtures/dpo
"$py" -c "import json, random, sys
r, warm, cold = random.Random(1), 'red orange warm sunny bright hot'.split(), 'blue grey cold icy dark pale'.split()
for _ in range(64):
    n = r.randint(2, 4)
    print(json.dumps({'prompt': 'Colours: ' + ' '.join(r.choice(warm + cold) for _ in range(3)) + '.',
                      'chosen': ' ' + ' '.join(r.choice(warm) for _ in range(n)) + '.',
                      'rejected': ' ' + ' '.join(r.choice(cold) for _ in range(n)) + '.'}))" > "$tmp/pairs.jsonl"
(cd "$here" && PYTHONPATH=$here "$py" -m trainer.cli prepare "$tmp/pairs.jsonl" --out "$tmp/pairs/pairs.bin" --tokenizer "$fix/policy" \
  --max-length 32 --heldout 0 --no-progress >/dev/null 2>&1)

TINY=(model.preset=tiny train.batch_size=16)
MOE=(model.family=mixtral model.n_experts=4 model.router_aux_loss=0.01 model.router_z_loss=0.001)
DPO=(train.objective=dpo data.source=PAIRS "model.init_from=$fix/policy" "dpo.reference=$fix/reference" model.seq_len=64
     train.batch_size=16 train.eval_every=0)
declare -A CASES=(
  ["default auto"]="${TINY[*]} mesh.data=8 train.zero_stage=3 train.grad_sync=auto"
  ["default ring"]="${TINY[*]} mesh.data=8 train.zero_stage=3 train.grad_sync=ring"
  ["MoE (2,1,4) ZeRO-3"]="${TINY[*]} ${MOE[*]} mesh.data=2 mesh.model=4 train.zero_stage=3"
  ["ring context 2 (2,1,2) ZeRO-3"]="${TINY[*]} mesh.data=2 mesh.context=2 mesh.model=2 train.zero_stage=3 train.context_attention=ring"
  ["DPO (8,1,1) ZeRO-3"]="${DPO[*]} mesh.data=8 train.zero_stage=3"
  ["DPO (4,2,1) ZeRO-3 1F1B"]="${DPO[*]} mesh.data=4 mesh.stage=2 train.zero_stage=3 train.microbatches=2 train.pipeline_schedule=1f1b"
)
ORDER=("default auto" "default ring" "MoE (2,1,4) ZeRO-3" "ring context 2 (2,1,2) ZeRO-3" "DPO (8,1,1) ZeRO-3"
       "DPO (4,2,1) ZeRO-3 1F1B")

run() {  # run SRC_DIR DIR KEYS...: train, then print each step's metrics (repr)
  local src=$1 dir=$2; shift 2
  cp -r "$tmp/pairs" "$dir.pairs"  # each revision computes its own reference log-probabilities beside the pairs
  # run inside the tree: `python -m` puts the working folder first on sys.path, before PYTHONPATH
  if ! cd "$src" || ! PYTHONPATH="$src" "$py" -m trainer.cli train "${@/#data.source=PAIRS/data.source=$dir.pairs/pairs.bin}" train.steps=4 \
      train.dtype=bfloat16 train.optimizer=sgd train.grad_clip=0 run.progress=false run.log_every=1 "run.dir=$dir" \
      > "$dir.log" 2>&1; then
    echo "failed: $(tail -1 "$dir.log")"; return
  fi
  "$py" -c "import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    if 'loss' in d:
        print(d['step'], *(f'{k}={d[k]!r}' for k in sorted(d) if k in ('loss', 'grad_norm') or k.split('/')[0] in
                                                                    ('aux', 'moe', 'rewards', 'logps')))" "$dir/metrics.jsonl"
}
largest() {  # largest A B: each metric's largest relative difference over the steps, where both runs have them
  "$py" -c "import sys
a, b = ([dict(kv.split('=') for kv in ln.split()[1:]) for ln in x.splitlines() if '=' in ln] for x in sys.argv[1:])
if len(a) == len(b) and a:
    rel = {k: max(abs(float(y[k]) / float(x[k]) - 1) if float(x[k]) else abs(float(y[k])) for x, y in zip(a, b))
           for k in a[0]}
    print(' (largest relative difference: ' + ', '.join(f'{k} {v:.1e}' for k, v in rel.items()) + ')')" "$1" "$2"
}
same=0
for i in "${!ORDER[@]}"; do
  name=${ORDER[$i]}
  read -ra keys <<< "${CASES[$name]}"
  a=$(run "$tmp/rev" "$tmp/rev_$i" "${keys[@]}" "$@")
  b=$(run "$here" "$tmp/head_$i" "${keys[@]}" "$@")
  if [[ -n $a && $a == "$b" && $a != failed* ]]; then
    echo "$name: same metrics, bit for bit ($(wc -l <<< "$a") steps)"
  else
    same=1; echo "$name: DIFFERENT$(largest "$a" "$b")"; diff <(echo "$a") <(echo "$b") | sed 's/^/  /' || true
  fi
done
exit $same
