"""Model families: Llama (the default), Qwen2/Qwen3, Mistral, Gemma 2/3 and the Mixture-of-Experts families. Each
module registers a ModelSpec (models/spec.py names what a family declares)."""
