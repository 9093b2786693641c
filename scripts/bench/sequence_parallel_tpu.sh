#!/bin/bash
# The 7B with tensor parallelism over 8 chips on TPU v5p-256 (data 16, ZeRO-3, one 4096- or 8192-token sequence per
# 16 chips, full remat, bfloat16), compiled ahead of time: meshtrain with and without train.sequence_parallel beside
# MaxText 0.2.5's train_compile with ici_tensor_sequence_parallelism=8 and ici_tensor_parallelism=8, in one venv
# with libtpu and maxtext (PY, default python3; docs/parallelism.md "Sequence parallelism"). Prints XLA:TPU's temp
# bytes per chip of each.
# Usage: scripts/bench/sequence_parallel_tpu.sh [4096|8192]
PY=${PY:-python3}
T=${1:-4096}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$(mktemp -d)
SITE=$($PY -c 'import maxtext, os; print(os.path.dirname(maxtext.__file__))') || exit 2
maxtext() {
  (cd "$OUT" && JAX_PLATFORMS=cpu DECOUPLE_GCLOUD=TRUE $PY -m maxtext.trainers.pre_train.train_compile \
    "$SITE/configs/base.yml" model_name=llama2-7b compile_topology=v5p-256 compile_topology_num_slices=1 \
    per_device_batch_size=0.125 max_target_length="$T" ici_fsdp_parallelism=16 remat_policy=full dtype=bfloat16 \
    weight_dtype=float32 attention=dot_product enable_checkpointing=false dataset_type=synthetic "$@" 2>&1) \
    | grep -o ' temp_size_in_bytes=[0-9]*' | tail -1 | cut -d= -f2
}
ours() {
  (cd "$ROOT" && JAX_PLATFORMS=cpu PYTHONPATH="$ROOT" $PY -m trainer.cli plan --compile-for v5p:4x4x8 \
    model.preset=7b mesh.data=-1 mesh.model=8 train.zero_stage=3 train.batch_size=16 model.seq_len="$T" \
    model.remat=full train.dtype=bfloat16 "$@" --json) | $PY -c 'import json, sys; print(json.load(sys.stdin)["xla_tpu"]["temp_bytes"])'
}
echo "T=$T, XLA:TPU temp bytes per chip"
echo "MaxText ici_tensor_sequence_parallelism=8: $(maxtext ici_tensor_sequence_parallelism=8)"
echo "meshtrain train.sequence_parallel=true:    $(ours train.sequence_parallel=true)"
echo "MaxText ici_tensor_parallelism=8:          $(maxtext ici_tensor_parallelism=8)"
echo "meshtrain train.sequence_parallel=false:   $(ours train.sequence_parallel=false)"
rm -rf "$OUT"
