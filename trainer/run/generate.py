"""`meshtrain generate`: sample from a run's newest checkpoint with a KV cache, streamed as text: bytes, or
tokens decoded with the run's tokenizer (data.tokenizer: of its `meshtrain prepare` data, or an HF folder's own).

A plain prompt starts as the run's text documents start: `meshtrain prepare` encodes each as transformers'
tokenizer(text) does, with the special tokens tokenizer.json's post-processor puts before it (a BOS where it adds
one; transformers 5 ignores tokenizer_config.json's add_bos_token beside a tokenizer.json), and records them in the
sidecar (`text_specials`); an older sidecar without them means none, so none are added. Without a sidecar (a model
read straight from an HF folder, a bare .bin) the prompt gets them as transformers' tokenizer(prompt) does. Those
after a text (an EOS) are left out: the prompt is a document to continue. A `--chat` prompt is a user message (after
`--system`'s) rendered by the run's chat template with the generation prompt, encoded without them (the template
writes its own BOS). Decoding stops at the model's end-of-text and end-of-turn tokens: the generation config's
eos_token_id (int or list; config.json's when it has none), the tokenizer's eos, the token the chat template writes
after an assistant turn, and each `--stop` (an added token of the tokenizer, or a text). What stopped it is not
printed (transformers' decode with skip_special_tokens leaves the eos out too); other special tokens are.
"""
from __future__ import annotations

import codecs
import datetime as _dt
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.config.paths import check
from trainer.data import remote
from trainer.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class Completion:
    prompt_ids: list[int]  # what the model was given
    ids: list[int]  # the new tokens, the stop token last where one stopped them (as transformers returns them)
    text: str  # what was printed of them: without the stop token or stop text
    stopped: bool  # False: --tokens ran out
    stats: object = None  # --speculative: what the drafts did (models/speculative.py Stats)


def _check(run_dir: str, n_tokens: int, temperature: float, top_k: int, chat: bool, system, stops,
           speculative: bool = False):
    check(run_dir, "--run")
    if not remote.is_url(run_dir) and not Path(run_dir).is_dir():  # a URL: load_params says what it lacks
        raise UserError(f"--run '{run_dir}' is not a directory; give the run.dir of a trained run")
    if n_tokens < 1:
        raise UserError(f"--tokens {n_tokens} must be at least 1")
    if temperature < 0:
        raise UserError(f"--temperature {temperature} must be >= 0 (0 = greedy)")
    if top_k < 0:
        raise UserError(f"--top_k {top_k} must be >= 0 (0 = no cut-off)")
    if system is not None and not chat:
        raise UserError("--system is a chat's system message; add --chat (the prompt becomes the user's message)")
    if any(not s for s in stops):
        raise UserError("--stop '' is empty; give a token of the tokenizer (e.g. '<|im_end|>') or a text")
    if speculative and temperature != 0:
        raise UserError(f"--speculative decodes greedily (the main model's greedy output, drafted by its "
                        f"multi-token-prediction modules); drop --temperature {temperature} or set it to 0")


def generate_text(run_dir: str, prompt: str = "", n_tokens: int = 256, temperature: float = 0.8,
                  top_k: int = 40, seed: int = 0, step: int | None = None, out=None, chat: bool = False,
                  system: str | None = None, stops: tuple[str, ...] = (), speculative: bool = False) -> str:
    """Write the prompt (not with `chat`) and up to n_tokens sampled tokens to `out` as they come; return the new
    text. `speculative`: greedy, drafted by the model's multi-token-prediction modules (models/speculative.py)."""
    return completion(run_dir, prompt, n_tokens, temperature, top_k, seed, step, out, chat, system, stops,
                      speculative).text


def completion(run_dir: str, prompt: str = "", n_tokens: int = 256, temperature: float = 0.8, top_k: int = 40,
               seed: int = 0, step: int | None = None, out=None, chat: bool = False, system: str | None = None,
               stops: tuple[str, ...] = (), speculative: bool = False) -> Completion:
    """generate_text, returning the token ids as well (and, speculative, the drafts' Stats as .stats)."""
    _check(run_dir, n_tokens, temperature, top_k, chat, system, stops, speculative)
    import jax
    from models.decode import fit_prompt, generate
    from trainer.config import model_config
    from trainer.ckpt.hf import context_of, origin_of
    from trainer.ckpt.params import load_params
    out = out or sys.stdout
    # one local device holds the weights whatever mesh saved them; decoding is one sequence
    params, cfg = load_params(run_dir, step, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]),
                              mtp_present=speculative)
    if cfg.data.source.endswith(".bin") and not cfg.data.tokenizer:
        raise UserError(f"run '{run_dir}' was trained on token ids ({cfg.data.source}) with no tokenizer recorded; "
                        "generate decodes bytes, so use a run trained on text or on `meshtrain prepare` data")
    mc = model_config(cfg)
    origin = origin_of(cfg, run_dir)  # the HF folder the model came from: its context and generation config
    context = context_of(origin) or mc.seq_len
    codec = _Tokens(cfg, chat) if cfg.data.tokenizer else _Bytes()
    ids = codec.chat(run_dir, prompt, system) if chat else codec.encode(prompt)
    stop_ids, stop_texts = _stops(codec, origin, stops)
    kept = fit_prompt(np.asarray([ids], np.int32), context)  # its warning comes before anything is printed
    if speculative:
        _check_drafts(run_dir, mc, kept, n_tokens, context)
    if not chat:
        out.write(prompt)
    stats = None
    if speculative:
        tokens, stats = _drafted(run_dir, mc, params, kept, n_tokens, context, codec.vocab)
    else:
        tokens = (int(t[0]) for t in generate(mc, params, kept, n_tokens, temperature=temperature, top_k=top_k,
                                              seed=seed, context=context, vocab=codec.vocab))
    new, text, stopped = _stream(tokens, codec.decoder(), stop_ids, stop_texts, out)
    out.write("\n")
    out.flush()
    return Completion(ids, new, text, stopped, stats)


def _check_drafts(run_dir: str, mc, kept, n_tokens: int, context: int):
    """A one-line error unless the model has modules to draft with and the prompt and tokens fit its context."""
    if not mc.mtp_depth:
        raise UserError(f"--speculative drafts with the model's multi-token-prediction modules, and '{run_dir}' has "
                        "none (model.mtp_depth=0, or an HF folder without model.layers.<num_hidden_layers>.*); train "
                        "with model.mtp_depth=1, or drop --speculative")
    if kept.shape[1] + n_tokens > context:
        raise UserError(f"--speculative keeps the prompt ({kept.shape[1]} tokens) and --tokens {n_tokens} in the "
                        f"model's context of {context} positions; lower --tokens to {context - kept.shape[1]} or less")


def _drafted(run_dir: str, mc, params: dict, kept, n_tokens: int, context: int, vocab: int):
    """(the tokens, Stats) of speculative decoding with the model's multi-token-prediction modules as drafts."""
    from models.speculative import Stats, speculative
    stats = Stats()
    return speculative(mc, params, kept[0], n_tokens, stats, vocab=vocab), stats


def _stream(tokens, decoder, stop_ids: set, stop_texts: tuple, out) -> tuple[list[int], str, bool]:
    """Print the tokens' text as it comes until a stop token (not printed) or a stop text (printed up to it):
    text that may be the start of a stop text is held back until the next tokens tell."""
    step, end = decoder
    ids, shown, held = [], [], ""

    def show(text):
        shown.append(text)
        out.write(text)
        out.flush()

    for t in tokens:
        ids.append(t)
        if t in stop_ids:
            show(held + end())
            return ids, "".join(shown), True
        held += step(t)
        cut = min((i for i in (held.find(s) for s in stop_texts) if i >= 0), default=None)
        if cut is not None:
            show(held[:cut])
            return ids, "".join(shown), True
        keep = max((k for s in stop_texts for k in range(1, len(s)) if held.endswith(s[:k])), default=0)
        show(held[:len(held) - keep])
        held = held[len(held) - keep:]
    show(held + end())
    return ids, "".join(shown), False


def _stops(codec, origin: Path | None, given) -> tuple[set[int], tuple[str, ...]]:
    """(token ids, texts) that end the generation: the model's and the tokenizer's eos, the template's end-of-turn
    token, and each --stop: a token where the tokenizer has it as an added token, else a text."""
    ids, texts = _model_eos(origin) | codec.eos(), []
    for s in given:
        i = codec.token(s)
        if i is None:
            texts.append(s)
        else:
            ids.add(i)
    return ids, tuple(texts)


def _model_eos(origin: Path | None) -> set[int]:
    """eos_token_id (an id or a list) of the HF folder's generation_config.json, else of its config.json."""
    for name in ("generation_config.json", "config.json") if origin is not None else ():
        f = origin / name
        if not f.is_file():
            continue
        try:
            eos = json.loads(f.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            raise UserError(f"{f} is not a readable JSON object; save the model again") from None
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in eos):
            raise UserError(f"{f}: eos_token_id {eos} is not a token id or a list of them; fix it")
        if eos:
            return set(eos)
    return set()


class _Bytes:
    """A byte-level run: a token is a byte; no chat template, no end-of-text token."""
    vocab = 256  # the ids it decodes: generation draws no other (a vocabulary wider than bytes pads)

    def encode(self, prompt: str) -> list[int]:
        return list(prompt.encode("utf-8")) or [ord("\n")]  # an empty prompt starts a new line

    def chat(self, run_dir, prompt, system):
        raise UserError(f"--chat needs a chat template, and run '{run_dir}' decodes bytes (no tokenizer, no "
                        "template); drop --chat, or train on `meshtrain prepare` conversations")

    def eos(self) -> set[int]:
        return set()

    def token(self, text: str) -> None:
        return None

    def decoder(self):
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # ids past the byte range exist only in a vocabulary wider than 256; show them as U+FFFD
        return (lambda t: decoder.decode(bytes([t])) if t < 256 else "\ufffd"), lambda: decoder.decode(b"", final=True)


class _Tokens:
    """The run's tokenizer (data.tokenizer), its eos, its added tokens and the run's chat template."""

    def __init__(self, cfg, chat: bool):
        from trainer.data.prepare import load_tokenizer
        from trainer.data.sidecars import data_sidecar, local_tokenizer
        path = local_tokenizer(cfg.data.tokenizer)  # data in a bucket: its tokenizer copied here
        if not Path(path).exists():
            raise UserError(f"the run's tokenizer '{path}' (data.tokenizer) is missing; put the file back "
                            "there (the run's config.yaml names it)")
        self.tok, file, self.eot = load_tokenizer(path)
        self.added = {t.content: i for i, t in self.tok.get_added_tokens_decoder().items()}
        meta = data_sidecar(cfg.data.source)
        self.start = self._document_start(cfg.data.source, meta)
        self.template = _template(meta, cfg.data.source, file.parent, chat)

    def _document_start(self, source: str, meta: dict | None) -> list[int]:
        """What the run's text documents start with: the sidecar's record (none in one written before it was
        kept); without a sidecar (a model straight from an HF folder, a bare .bin) what tokenizer(text) puts
        first, as transformers does."""
        from trainer.data.records import text_specials
        if meta is not None:
            return list(meta.get("text_specials", {}).get("before", []))
        if source.endswith(".bin") and not remote.is_url(source) and not Path(source).exists():
            log.warning("generate: the run's data %s is gone, so how its documents start is not known; a plain "
                        "prompt starts as the tokenizer's tokenizer(prompt) does", source)
        return text_specials(self.tok, self.eot)[0]

    def encode(self, prompt: str) -> list[int]:
        # as the data's documents start; an empty prompt with nothing to start with follows an end-of-text
        return (self.start + self.tok.encode(prompt, add_special_tokens=False).ids) or [self.eot]

    def chat(self, run_dir, prompt: str, system: str | None) -> list[int]:
        from trainer.data.chat import TemplateFailed
        if self.template is None:
            raise UserError(f"--chat needs a chat template, and run '{run_dir}' has none (not in its data's "
                            "sidecar, nor chat_template.jinja or tokenizer_config.json beside its tokenizer); "
                            "drop --chat, or add the template there")
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": prompt}]
        try:
            text = self.template.render(messages, add_generation_prompt=True)
        except TemplateFailed as e:
            raise UserError(f"the chat template {self.template.source} failed on the message ({e}); change "
                            "--prompt / --system, or fix the template") from None
        return self.tok.encode(text, add_special_tokens=False).ids  # the template wrote the special tokens

    def eos(self) -> set[int]:
        turn = self.template.end_of_turn(self.added) if self.template else None
        return {self.eot} | ({turn} if turn is not None else set())

    def token(self, text: str) -> int | None:
        return self.added.get(text)

    @property
    def vocab(self) -> int:
        """The ids it decodes: generation draws no other (a model.vocab_size padded past it has rows no token's)."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    def decoder(self):
        from tokenizers.decoders import DecodeStream
        stream, vocab = DecodeStream(skip_special_tokens=False), self.vocab
        # DecodeStream holds back ids that end inside a UTF-8 character until it is whole; ids the model has
        # but the tokenizer lacks (a wider model.vocab_size) show as U+FFFD
        return (lambda t: (stream.step(self.tok, t) or "") if t < vocab else "\ufffd"), lambda: ""


def _template(meta: dict | None, source: str, folder: Path, chat: bool):
    """The run's chat template: the one its prepared conversations were rendered with (the sidecar `meta` of the
    `source` names it), else the tokenizer folder's; None without one. A template that does not parse is an error
    for --chat, and for plain generation only a warning (it then gives no end-of-turn token)."""
    from trainer.data.chat import ChatTemplate, specials_of, template_text
    from trainer.data.sidecars import beside, read_beside
    kept = meta and meta.get("chat_template")
    found = None
    if kept:
        f = beside(source, kept["path"])
        try:
            found = (f, read_beside(source, kept["path"]))
        except (OSError, UserError) as e:
            raise UserError(f"the chat template of the run's data, {f}, cannot be read "
                            f"({getattr(e, 'strerror', None) or e}); put it back (meshtrain prepare wrote it beside "
                            "the .bin)") from None
    found = found or template_text(folder)
    if found is None:
        return None
    try:  # today's date for strftime_now, as transformers' apply_chat_template
        return ChatTemplate(found[0], found[1], specials_of(folder), _dt.date.today())
    except UserError as e:
        if chat:
            raise
        log.warning("%s; generating without its end-of-turn token", e)
        return None
