#!/bin/bash
# gpt-oss-20b's step compiled for TPU v5p (32 chips, ZeRO-3, batch 1 x 4096 per chip, full remat, bfloat16), meshtrain's
# beside MaxText's train_compile of the same model (needs a venv with libtpu and maxtext: PY, default python3).
# Usage: scripts/bench/gpt_oss_tpu.sh ours [train.expert_parallel=false] | maxtext
PY=${PY:-python3}
L=$(printf 'true,false,%.0s' {1..12}); L=${L%,}
case "$1" in
  ours) shift; JAX_PLATFORMS=cpu $PY -m trainer.cli plan model.preset=7b model.family=gpt_oss model.d_model=2880 \
    model.n_layers=24 model.n_heads=64 model.n_kv_heads=8 model.head_dim=64 model.d_ff=2880 model.expert_d_ff=2880 \
    model.n_experts=32 model.n_experts_per_token=4 model.window=128 "model.local_layers=[$L]" model.vocab_size=201088 \
    model.seq_len=4096 model.rope_theta=150000 model.yarn_factor=32 model.yarn_original=4096 model.yarn_truncate=false \
    model.swiglu_limit=7 model.tie_embeddings=false model.remat=full train.zero_stage=3 train.batch_size=32 \
    train.dtype=bfloat16 mesh.data=32 "$@" --compile-for v5p:2x4x4 --json ;;
  maxtext) JAX_PLATFORMS=cpu $PY -m maxtext.trainers.pre_train.train_compile \
    "$($PY -c 'import maxtext, os; print(os.path.dirname(maxtext.__file__))')/configs/base.yml" model_name=gpt-oss-20b \
    compile_topology=v5p-64 compile_topology_num_slices=1 per_device_batch_size=1 max_target_length=4096 \
    remat_policy=full dataset_type=synthetic enable_checkpointing=false ;;
  *) echo "usage: $0 ours [keys...] | maxtext" >&2; exit 2 ;;
esac
