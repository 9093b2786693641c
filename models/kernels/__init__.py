"""Kernels: which attention runs (`attention`), XLA:CPU fast paths (`fast_cpu`, `flash_cpu` for long rows), the MoE
experts' matmuls and their dispatch (`experts`) and the TPU's grouped matmul (`moe_tpu`). Each is a drop-in for a
plain function of models/transformer.py or models/families/moe.py and equals it in exact arithmetic."""
