"""Hugging Face adapters, one module per family group: config.json <-> ModelConfig keys and tensor names <-> the
inventory's parameters, both directions (trainer/ckpt/hf.py reads and writes the files)."""
