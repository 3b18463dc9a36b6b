"""A small text corpus the project writes itself: seeded, character-level, no download.

Each story hides a few facts in plain sentences and later asks about them, so that predicting the answer
characters needs attention to the right earlier sentence (the retrieval skill of the needle task, in text)::

    ada put the red cup in the box. the sun is warm. bo put the blue key on the shelf. ...
    where is the red cup? in the box. where is the blue key? on the shelf.

:func:`generate_corpus` is deterministic for a seed (Python's ``random.Random``, which is stable across
versions and platforms), :data:`ALPHABET` is the character vocabulary, and :class:`TextTask` cuts training
windows out of the corpus, one seeded window per row.

>>> text = generate_corpus(n_stories=2, seed=0)
>>> set(text) <= set(ALPHABET)
True
>>> TextTask(seq_len=32).sample_row(torch.Generator().manual_seed(0))[0].shape
torch.Size([32])
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

ALPHABET: str = "\n .?abcdefghijklmnopqrstuvwxyz"
"""Every character the corpus uses; token id = position in this string."""

NAMES = ("ada", "bo", "cy", "dee", "eli", "fay", "gus", "ivy", "jo", "kim", "lou", "max")
COLOURS = ("red", "blue", "green", "black", "white", "pink", "grey", "gold")
THINGS = ("cup", "key", "hat", "book", "coin", "shoe", "lamp", "ring", "map", "bell")
PLACES = ("in the box", "on the shelf", "under the bed", "in the bag", "by the door", "on the desk",
          "in the car", "near the tree")
FILLER = ("the sun is warm.", "a dog barks.", "it rains a bit.", "the tea is hot.", "a bird sings.",
          "the room is quiet.", "time goes by.", "the wind is cold.")


def _story(rng: random.Random, n_facts: int, n_filler: int) -> str:
    """One story: ``n_facts`` facts among ``n_filler`` filler sentences, then a question about each fact."""
    things = rng.sample([(c, t) for c in COLOURS for t in THINGS], n_facts)
    facts = [f"{rng.choice(NAMES)} put the {c} {t} {rng.choice(PLACES)}." for c, t in things]
    answers = {f"{c} {t}": fact.split(f"{c} {t} ")[1] for (c, t), fact in zip(things, facts)}
    sentences = facts + [rng.choice(FILLER) for _ in range(n_filler)]
    rng.shuffle(sentences)
    questions = [f"where is the {obj}? {place}" for obj, place in answers.items()]
    rng.shuffle(questions)
    return " ".join(sentences + questions) + "\n"


@functools.lru_cache(maxsize=4)
def generate_corpus(n_stories: int = 2000, seed: int = 0) -> str:
    """``n_stories`` stories (2 to 4 facts and 2 to 6 filler sentences each) as one string, the same for a seed."""
    rng = random.Random(seed)
    return "".join(_story(rng, rng.randint(2, 4), rng.randint(2, 6)) for _ in range(n_stories))


def encode(text: str) -> Tensor:
    """Characters of :data:`ALPHABET` -> token ids ``(len(text),)`` long."""
    index = {ch: i for i, ch in enumerate(ALPHABET)}
    try:
        return torch.tensor([index[ch] for ch in text], dtype=torch.long)
    except KeyError as e:
        raise ValueError(f"character {e.args[0]!r} is not in the corpus alphabet {ALPHABET!r}") from None


def decode(ids: Tensor) -> str:
    """Token ids ``(N,)`` -> text."""
    return "".join(ALPHABET[i] for i in ids.tolist())


@dataclass(frozen=True)
class TextTask:
    """Next-character prediction on windows of ``seq_len`` characters of :func:`generate_corpus`."""

    seq_len: int = 128
    n_stories: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_len", "n_stories"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TextTask.{name} must be a positive whole number, got {value!r}")

    @property
    def vocab_size(self) -> int:
        return len(ALPHABET)

    @functools.cached_property
    def tokens(self) -> Tensor:
        """The whole corpus as token ids ``(T,)``."""
        ids = encode(generate_corpus(self.n_stories, self.seed))
        if len(ids) <= self.seq_len:
            raise ValueError(f"the corpus has {len(ids)} characters, too few for seq_len={self.seq_len}; "
                             f"raise n_stories")
        return ids

    def sample_row(self, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """One window: ``tokens (seq_len,)`` and ``targets (seq_len,)``, the next character at each position."""
        start = int(torch.randint(0, len(self.tokens) - self.seq_len, (1,), generator=generator))
        window = self.tokens[start:start + self.seq_len + 1]
        return window[:-1], window[1:]


def next_character_loss(model: Callable[[Tensor], Tensor], tokens: Tensor, targets: Tensor) -> Tensor:
    """The text task's loss: cross-entropy of the next character at every position, ``tokens (B, L)`` through
    ``model`` to logits ``(B, L, V)`` against ``targets (B, L)``."""
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


__all__ = ["ALPHABET", "generate_corpus", "encode", "decode", "TextTask", "next_character_loss"]
