"""A seeded synthetic multi-needle retrieval task, in the spirit of the paper's Table 2.

A sequence is a haystack of ``context_len`` filler tokens with ``N`` needles hidden in it, followed by ``R``
queries. A needle is one token that states a fact, ``k3=v9`` ("key 3 holds value 9"), with distinct keys
within a haystack; a query is ``? k3 v9``: after the queried key the model must produce that key's value.
The ``N - R`` needles never asked about are look-alike distractors; the filler is noise, partly made of
bare value tokens (``v5``) that look like answers::

    BOS  .  v5  k3=v9  .  .  k7=v2  .  v1 ... .   ? k7 v2   ? k3 v9
         `------------- context (haystack) -----'  `--- queries ---'

Every :class:`NeedleBatch` carries the positions that hold each answer, so attention can be scored (Table 3:
share of the query's attention on the answer needle versus on the rest of the context).

>>> task = NeedleTask()
>>> b = task.sample(4, n_needles=6, n_queries=2, generator=torch.Generator().manual_seed(0))
>>> b.tokens.shape, b.query_pos.shape, b.answer_mask.shape
(torch.Size([4, 103]), torch.Size([4, 2]), torch.Size([4, 2, 103]))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

BOS, QUERY = 0, 1
IGNORE = -100
"""Target id that ``F.cross_entropy`` ignores (positions with nothing to predict)."""


class NeedleBatch(NamedTuple):
    """One batch of the retrieval task (``B`` sequences of ``L`` tokens, ``R`` queries each).

    tokens ``(B, L)`` long; targets ``(B, L)`` long, the token to predict **next** at each position (the
    answer value at each queried key, :data:`IGNORE` elsewhere); query_pos ``(B, R)`` the queried keys'
    positions; answers ``(B, R)`` the value ids; answer_mask ``(B, R, L)`` bool, the position of the queried
    needle; context_mask ``(L,)`` bool, the haystack positions (filler and needles); needle_mask ``(B, L)``
    bool, every needle's position; depth ``(B, R)`` float, where the answer sits in the haystack (0 = first
    position, 1 = last).
    """

    tokens: Tensor
    targets: Tensor
    query_pos: Tensor
    answers: Tensor
    answer_mask: Tensor
    context_mask: Tensor
    needle_mask: Tensor
    depth: Tensor


@dataclass(frozen=True)
class NeedleTask:
    """Vocabulary and haystack of the task.

    Token ids: ``0`` BOS, ``1`` the query marker ``?``, then ``n_keys`` keys, ``n_values`` values,
    ``n_keys * n_values`` needles (``k=v``) and ``n_filler`` filler tokens. Each haystack position that is not
    a needle holds a bare value token with probability ``value_noise``, else a filler token.
    """

    n_keys: int = 8
    n_values: int = 8
    n_filler: int = 16
    context_len: int = 96
    value_noise: float = 0.25

    @property
    def key_ids(self) -> range:
        return range(2, 2 + self.n_keys)

    @property
    def value_ids(self) -> range:
        return range(self.key_ids.stop, self.key_ids.stop + self.n_values)

    @property
    def needle_ids(self) -> range:
        """Needle ``k=v`` has id ``needle_ids.start + k * n_values + v``."""
        return range(self.value_ids.stop, self.value_ids.stop + self.n_keys * self.n_values)

    @property
    def filler_ids(self) -> range:
        return range(self.needle_ids.stop, self.needle_ids.stop + self.n_filler)

    @property
    def vocab_size(self) -> int:
        return self.filler_ids.stop

    def seq_len(self, n_queries: int) -> int:
        """Tokens in a sequence with ``n_queries`` queries: BOS, the haystack, three per query."""
        return 1 + self.context_len + 3 * n_queries

    def sample(self, batch_size: int, n_needles: int, n_queries: int, *,
               generator: Optional[torch.Generator] = None) -> NeedleBatch:
        """A batch with ``n_needles`` needles per haystack, ``n_queries`` of them asked (in random order)."""
        if not 1 <= n_queries <= n_needles:
            raise ValueError(f"need 1 <= n_queries <= n_needles, got n_queries={n_queries}, n_needles={n_needles}")
        if n_needles > self.n_keys:
            raise ValueError(f"{n_needles} needles need distinct keys but the task has n_keys={self.n_keys}")
        if n_needles > self.context_len:
            raise ValueError(f"{n_needles} needles do not fit a context of {self.context_len}")
        g, B, C, N, R = generator, batch_size, self.context_len, n_needles, n_queries
        filler = torch.randint(self.filler_ids.start, self.filler_ids.stop, (B, C), generator=g)
        bare = torch.randint(self.value_ids.start, self.value_ids.stop, (B, C), generator=g)
        ctx = torch.where(torch.rand(B, C, generator=g) < self.value_noise, bare, filler)
        starts = torch.rand(B, C, generator=g).argsort(dim=1)[:, :N]  # distinct needle positions
        keys = torch.rand(B, self.n_keys, generator=g).argsort(dim=1)[:, :N]  # distinct keys, 0-based
        values = torch.randint(0, self.n_values, (B, N), generator=g)
        ctx.scatter_(1, starts, self.needle_ids.start + keys * self.n_values + values)
        asked = torch.rand(B, N, generator=g).argsort(dim=1)[:, :R]  # which needles are queried, in order
        q_keys = keys.gather(1, asked) + self.key_ids.start
        q_values = values.gather(1, asked) + self.value_ids.start
        query = torch.stack([torch.full_like(q_keys, QUERY), q_keys, q_values], dim=2).flatten(1)
        tokens = torch.cat([torch.full((B, 1), BOS), ctx, query], dim=1)
        L = tokens.shape[1]
        query_pos = (1 + C + 3 * torch.arange(R) + 1).expand(B, R).contiguous()  # each queried key
        targets = torch.full((B, L), IGNORE)
        targets.scatter_(1, query_pos, q_values)
        pos = torch.arange(L)
        answer_pos = 1 + starts.gather(1, asked)  # (B, R) token positions of the queried needles
        answer_mask = pos == answer_pos[..., None]
        context_mask = (pos >= 1) & (pos < 1 + C)
        needle_mask = (pos == 1 + starts[..., None]).any(1)
        depth = (answer_pos - 1).float() / max(1, C - 1)
        return NeedleBatch(tokens, targets, query_pos, q_values, answer_mask, context_mask, needle_mask, depth)

    def describe(self, tokens: Tensor) -> str:
        """One sequence ``(L,)`` as text: ``^`` BOS, ``?`` query, ``k3``, ``v9``, ``k3=v9`` needle, ``.`` filler."""
        out = []
        for t in tokens.tolist():
            if t == BOS:
                out.append("^")
            elif t == QUERY:
                out.append("?")
            elif t in self.key_ids:
                out.append(f"k{t - self.key_ids.start}")
            elif t in self.value_ids:
                out.append(f"v{t - self.value_ids.start}")
            elif t in self.needle_ids:
                k, v = divmod(t - self.needle_ids.start, self.n_values)
                out.append(f"k{k}=v{v}")
            else:
                out.append(".")
        return " ".join(out)


SETTINGS: tuple[tuple[int, int], ...] = ((1, 1), (2, 2), (4, 2), (6, 2))
"""``(needles, queried)`` settings of the paper's Table 2: the course's trainers cycle through them."""


def retrieval_loss(model: torch.nn.Module, batch: NeedleBatch) -> Tensor:
    """Cross-entropy of the next-token prediction at each queried key (``batch.targets``; the rest is ignored)."""
    logits = model(batch.tokens)
    return F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE)


__all__ = ["BOS", "QUERY", "IGNORE", "NeedleBatch", "NeedleTask", "SETTINGS", "retrieval_loss"]
