"""A byte-level BPE trained on the corpus, saved as a Hugging Face tokenizer directory.

Sits just above ``corpus.py``. The vocabulary holds two special tokens: ``<|endoftext|>`` (EOS, also
the pad token) and ``<|mask|>``, the DFlash mask id: a real embedding row of the target, which the
drafter's blocks are filled with.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dflash_jax.io import atomic
from dflash_jax.train import corpus

EOS, MASK = "<|endoftext|>", "<|mask|>"
SPECIAL_TOKENS = (EOS, MASK)


MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # the byte alphabet and the specials


def train_tokenizer(files: list[Path], vocab_size: int = 4096, *, texts: Iterable[str] | None = None) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokeniser, no prefix space) on ``files`` (or ``texts``); specials get ids
    0 and 1."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab size {vocab_size!r} must be at least {MIN_VOCAB} (256 bytes and "
                         f"{len(SPECIAL_TOKENS)} special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus.read_texts(files) if texts is None else texts, trainer=trainer)
    return tok


def save_hf(tok: Tokenizer, path: str | Path) -> None:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json (PreTrainedTokenizerFast)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path / "tokenizer.json", tok.to_str(pretty=True))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "rstrip": False, "normalized": False,
                                       "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS,
              "additional_special_tokens": [MASK], "added_tokens_decoder": added,
              "model_max_length": 262144, "clean_up_tokenization_spaces": False}
    atomic.write_text(path / "tokenizer_config.json", json.dumps(config, indent=2))
    special = {"eos_token": EOS, "pad_token": EOS, "additional_special_tokens": [MASK]}
    atomic.write_text(path / "special_tokens_map.json", json.dumps(special, indent=2))


def load(path: str | Path, flag: str | None = None) -> Tokenizer:
    """The tokenizer of a directory holding ``tokenizer.json`` (``save_hf``'s, or a Hugging Face model's); a missing
    or unreadable file is a ``ValueError`` naming it (and ``flag``, the option that gave ``path``)."""
    file = Path(path) / "tokenizer.json"
    given = f"{flag} {path}" if flag else str(path)
    if not file.is_file():
        why = "no such directory" if not Path(path).exists() else "not a directory" if not Path(path).is_dir() \
            else "it holds no tokenizer.json"
        raise ValueError(f"{given}: {why}; expected a tokenizer directory with {file.name} "
                         "(as dflash-jax train tokenizer --out writes, or a Hugging Face model's)")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
        raise ValueError(f"{file}: not a readable tokenizer ({e})") from None
