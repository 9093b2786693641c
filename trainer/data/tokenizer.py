"""The tokenizer a prepare encodes with: a Hugging Face tokenizer.json (its end-of-text token found by name), or a
byte-level BPE trained on the sources."""
from __future__ import annotations

import json
from pathlib import Path

from trainer.errors import UserError

EOT = "<|endoftext|>"
EOS_NAMES = (EOT, "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>")


def load_tokenizer(path: str):
    """(Tokenizer, its tokenizer.json path, end-of-text id) from a tokenizer.json or a folder holding one."""
    from tokenizers import Tokenizer
    p = Path(path)
    p = p / "tokenizer.json" if p.is_dir() else p
    if not p.is_file():
        raise UserError(f"--tokenizer '{path}' is not a tokenizer.json file or a folder holding one; "
                        "give a Hugging Face tokenizer.json or use --train-tokenizer VOCAB_SIZE")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # the library raises its own Exception type for any unparsable file
        raise UserError(f"--tokenizer '{path}' is not a tokenizer ({str(e).splitlines()[0][:120]}); give a "
                        "Hugging Face tokenizer.json or use --train-tokenizer VOCAB_SIZE") from None
    return tok, p, _eos_id(tok, p, path)


def _eos_id(tok, p: Path, path: str) -> int:
    names = list(EOS_NAMES)
    try:  # an HF folder names its eos token in tokenizer_config.json
        eos = json.loads((p.parent / "tokenizer_config.json").read_text()).get("eos_token")
        names.insert(0, eos.get("content") if isinstance(eos, dict) else eos)
    except (OSError, ValueError, AttributeError):
        pass
    for name in names:
        if isinstance(name, str) and (i := tok.token_to_id(name)) is not None:
            return i
    raise UserError(f"--tokenizer '{path}' has no end-of-text token (none of {', '.join(EOS_NAMES)}, nor "
                    "tokenizer_config.json's eos_token); add one to it or use --train-tokenizer VOCAB_SIZE")


def train_tokenizer(texts, vocab_size: int, length: int):
    """A byte-level BPE trained on the texts, with EOT as its one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer, length=length)
    return tok
