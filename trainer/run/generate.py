"""`meshtrain generate`: sample from a run's newest checkpoint with a KV cache, streamed as text: bytes, or
tokens decoded with the run's tokenizer (data.tokenizer) when it trained on `meshtrain prepare` data."""
from __future__ import annotations

import codecs
import sys
from pathlib import Path

import numpy as np

from trainer.errors import UserError


def _check(run_dir: str, n_tokens: int, temperature: float, top_k: int):
    if not Path(run_dir).is_dir():
        raise UserError(f"--run '{run_dir}' is not a directory; give the run.dir of a trained run")
    if n_tokens < 1:
        raise UserError(f"--tokens {n_tokens} must be at least 1")
    if temperature < 0:
        raise UserError(f"--temperature {temperature} must be >= 0 (0 = greedy)")
    if top_k < 0:
        raise UserError(f"--top_k {top_k} must be >= 0 (0 = no cut-off)")


def generate_text(run_dir: str, prompt: str = "", n_tokens: int = 256, temperature: float = 0.8,
                  top_k: int = 40, seed: int = 0, step: int | None = None, out=None) -> str:
    """Write the prompt and n_tokens sampled tokens (of the run's tokenizer, or bytes without one) to `out` as
    they come; return the new text."""
    _check(run_dir, n_tokens, temperature, top_k)
    import jax
    from models.decode import generate
    from trainer.config import model_config
    from trainer.ckpt.hf import context_of, origin_of
    from trainer.ckpt.params import load_params
    out = out or sys.stdout
    # one local device holds the weights whatever mesh saved them; decoding is one sequence
    params, cfg = load_params(run_dir, step, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    if cfg.data.source.endswith(".bin") and not cfg.data.tokenizer:
        raise UserError(f"run '{run_dir}' was trained on token ids ({cfg.data.source}) with no tokenizer recorded; "
                        "generate decodes bytes, so use a run trained on text or on `meshtrain prepare` data")
    mc = model_config(cfg)
    context = context_of(origin_of(cfg, run_dir))  # an HF model's own context, else the trained seq_len
    if cfg.data.tokenizer:
        ids, step_fn = _tokenizer_codec(cfg.data.tokenizer, prompt)
    else:
        ids = list(prompt.encode("utf-8")) or [ord("\n")]  # an empty prompt starts a new line
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # ids past the byte range exist only in a vocabulary wider than 256; show them as U+FFFD
        step_fn = lambda t: decoder.decode(bytes([t])) if t < 256 else "\ufffd"  # noqa: E731
    out.write(prompt)
    new = []
    for tok in generate(mc, params, np.asarray([ids], np.int32), n_tokens, temperature=temperature, top_k=top_k,
                        seed=seed, context=context):
        piece = step_fn(int(tok[0]))
        new.append(piece)
        out.write(piece)
        out.flush()
    tail = decoder.decode(b"", final=True) if not cfg.data.tokenizer else ""
    out.write(tail + "\n")
    out.flush()
    return "".join(new) + tail


def _tokenizer_codec(path: str, prompt: str):
    """The prompt's ids under the run's tokenizer and a step function: id -> the text it completes."""
    from tokenizers.decoders import DecodeStream
    from trainer.data.prepare import load_tokenizer
    if not Path(path).exists():
        raise UserError(f"the run's tokenizer '{path}' (data.tokenizer) is missing; put the file back "
                        "there (the run's config.yaml names it)")
    tok, _, eot = load_tokenizer(path)
    ids = tok.encode(prompt, add_special_tokens=False).ids or [eot]  # an empty prompt starts a new document
    stream, vocab = DecodeStream(skip_special_tokens=False), tok.get_vocab_size(with_added_tokens=True)
    # DecodeStream holds back ids that end inside a UTF-8 character until it is whole; ids the model has
    # but the tokenizer lacks (a wider model.vocab_size) show as U+FFFD
    return ids, lambda t: (stream.step(tok, t) or "") if t < vocab else "\ufffd"
