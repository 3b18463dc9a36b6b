"""Toy problems for the opening notebooks: the differential amplifier (01) and retrieval with distractors (02, 03).

Everything here is seeded and small enough for a laptop CPU.

* :func:`amplifier_output`, :func:`amplifier_gains`, :func:`cmrr_db`: the signal maths of a differential
  amplifier, the analogy the paper opens with (notebook 01; exercise 01 checks against these).
* :func:`amplifier_signals`: two input wires sharing common-mode noise, carrying a small signal between them.
* :func:`retrieval_toy`: queries that each look for one "needle" key among distractors that match the topic
  of the question but not its key, and unrelated filler: softmax attention spreads mass over all of them
  (notebook 02); a second, topic-only query gives differential attention a map of the shared part to
  subtract (notebook 03).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar, Union

import numpy as np
import torch

Tensor = torch.Tensor
Signal = TypeVar("Signal", float, np.ndarray, Tensor)
Number = Union[float, int]


# --------------------------------------------------------------------------------------------
# notebook 01: the differential amplifier
# --------------------------------------------------------------------------------------------


def amplifier_output(v_plus: Signal, v_minus: Signal, gain_plus: Number = 1.0, gain_minus: Number = 1.0) -> Signal:
    """The output of a differential amplifier: ``gain_plus * v_plus - gain_minus * v_minus``.

    ``v_plus`` and ``v_minus`` are the two input voltages (floats, NumPy arrays or tensors of one shape,
    e.g. samples over time). Equal gains amplify only the difference of the inputs, so whatever both
    inputs carry (the common mode) cancels; a gain mismatch lets ``(gain_plus - gain_minus)`` of it through.
    """
    return gain_plus * v_plus - gain_minus * v_minus


def amplifier_gains(gain_plus: Number = 1.0, gain_minus: Number = 1.0) -> tuple[float, float]:
    """``(differential_gain, common_mode_gain)`` of :func:`amplifier_output` with these input gains.

    Write the inputs as a common mode ``v_cm`` plus half the difference ``v_d`` each,
    ``v_plus = v_cm + v_d / 2``, ``v_minus = v_cm - v_d / 2``; then the output is
    ``(gain_plus + gain_minus) / 2 * v_d + (gain_plus - gain_minus) * v_cm``.
    """
    return (gain_plus + gain_minus) / 2, gain_plus - gain_minus


def cmrr_db(differential_gain: Union[Number, Tensor], common_mode_gain: Union[Number, Tensor]) -> Union[float, Tensor]:
    """The common-mode rejection ratio in decibels: ``20 * log10(|differential_gain| / |common_mode_gain|)``.

    Numbers give a float (``inf`` for a perfect amplifier, ``common_mode_gain == 0``; ``-inf`` when
    ``differential_gain == 0``; both zero is an error); tensors give a tensor, elementwise, with the same
    infinities (and NaN where both are zero).
    """
    if isinstance(differential_gain, Tensor) or isinstance(common_mode_gain, Tensor):
        ad = torch.as_tensor(differential_gain, dtype=torch.float64).abs()
        acm = torch.as_tensor(common_mode_gain, dtype=torch.float64).abs()
        return 20 * torch.log10(ad / acm)
    ad, acm = abs(float(differential_gain)), abs(float(common_mode_gain))
    if ad == 0 and acm == 0:
        raise ValueError("cmrr_db is undefined when both the differential and the common-mode gain are zero")
    if acm == 0:
        return math.inf
    if ad == 0:
        return -math.inf
    return 20 * math.log10(ad / acm)


@dataclass(frozen=True)
class AmplifierSignals:
    """Two input wires of a differential amplifier, sampled at times ``t`` (NumPy float64 arrays).

    ``v_plus = common + signal / 2`` and ``v_minus = common - signal / 2``: the wanted ``signal`` is the
    difference of the wires, the ``common``-mode noise (mains hum plus broadband noise) is on both.
    """

    t: np.ndarray
    signal: np.ndarray
    common: np.ndarray
    v_plus: np.ndarray
    v_minus: np.ndarray


def amplifier_signals(n_samples: int = 500, *, noise_level: float = 1.0, signal_amplitude: float = 0.2,
                      signal_hz: float = 3.0, hum_hz: float = 50.0, duration_s: float = 1.0,
                      seed: int = 0) -> AmplifierSignals:
    """A slow sine ``signal`` between two wires that both pick up the same ``common``-mode noise.

    The common mode is ``noise_level`` times (a mains-hum sine at ``hum_hz`` plus Gaussian noise of standard
    deviation 0.5); the same seed gives the same noise for every ``noise_level``.
    """
    if n_samples < 2:
        raise ValueError(f"n_samples must be >= 2, got {n_samples}")
    rng = np.random.default_rng(seed)
    t = np.linspace(0.0, duration_s, n_samples)
    signal = signal_amplitude * np.sin(2 * np.pi * signal_hz * t)
    common = noise_level * (np.sin(2 * np.pi * hum_hz * t) + 0.5 * rng.standard_normal(n_samples))
    return AmplifierSignals(t=t, signal=signal, common=common, v_plus=common + signal / 2,
                            v_minus=common - signal / 2)


# --------------------------------------------------------------------------------------------
# notebooks 02 and 03: retrieval with distractors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetrievalToy:
    """One sequence of ``N`` keys and ``Nq`` questions, in the attention layout ``(B=1, heads=1, len, dim)``.

    Attributes:
        q: ``(1, 1, Nq, d)`` the questions: query ``i`` matches the shared topic **and** needle ``i``'s key.
        q_common: ``(1, 1, Nq, d)`` the topic part of each question only (what every relevant-looking key
            matches): a second query for differential attention's second map.
        k: ``(1, 1, N, d)`` the keys: needles (topic + own key), distractors (topic only, weight 0.6-1),
            filler (a small random topic weight, the same for both queries of a question); every key also
            carries a little isotropic Gaussian noise, which the two queries of a question see differently.
        v: ``(1, 1, N, 2d)`` random values (standard normal), the payload a question retrieves.
        answer: bool ``(Nq, N)``: the needle of each question.
        distractor: bool ``(N,)``: the topic-only keys.
        context: bool ``(Nq, N)``: every key (all True); noise = context outside the answer.
        needles: long ``(Nq,)``: the position of each question's needle.
    """

    q: Tensor
    q_common: Tensor
    k: Tensor
    v: Tensor
    answer: Tensor
    distractor: Tensor
    context: Tensor
    needles: Tensor

    @property
    def n_keys(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]


def retrieval_toy(n_keys: int = 64, *, n_queries: int = 8, n_distractors: int = 8, head_dim: int = 16,
                  match: float = 2.5, topic_jitter: float = 0.3, key_noise: float = 0.05, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> RetrievalToy:
    """Build a seeded retrieval-with-distractors problem (see :class:`RetrievalToy`).

    The topic and the ``n_queries`` needle keys are orthonormal directions in ``head_dim`` dimensions.
    Queries are scaled by ``match * sqrt(head_dim)``, so after attention's ``1/sqrt(d)`` a question scores
    about ``2 * match`` on its needle, ``match`` on the other needles, ``0.6-1 x match`` on distractors and
    ``N(0, topic_jitter) x match`` on filler. ``key_noise`` is the standard deviation of the isotropic noise
    on every key: unlike the topic weights, it scores differently under ``q`` and ``q_common``. Needle and
    distractor positions are drawn at random without overlap.
    """
    if n_queries + 1 > head_dim:
        raise ValueError(f"head_dim={head_dim} must be > n_queries={n_queries} (orthogonal needle keys + topic)")
    if n_queries + n_distractors > n_keys:
        raise ValueError(f"n_keys={n_keys} must hold n_queries + n_distractors = {n_queries + n_distractors} keys")
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(head_dim, n_queries + 1, generator=g, dtype=torch.float64))
    topic, needle_dirs = basis[:, 0], basis[:, 1:].T  # (d,), (Nq, d)
    places = torch.randperm(n_keys, generator=g)
    needles, distractors = places[:n_queries], places[n_queries:n_queries + n_distractors]
    k = key_noise * torch.randn(n_keys, head_dim, generator=g, dtype=torch.float64)
    weights = topic_jitter * torch.randn(n_keys, generator=g, dtype=torch.float64)  # filler: about 0
    weights[needles] = 1.0
    weights[distractors] = 0.6 + 0.4 * torch.rand(n_distractors, generator=g, dtype=torch.float64)
    k += weights[:, None] * topic
    k[needles] += needle_dirs
    v = torch.randn(n_keys, 2 * head_dim, generator=g, dtype=torch.float64)
    scale = match * math.sqrt(head_dim)
    q = scale * (topic + needle_dirs)
    q_common = scale * topic.expand(n_queries, head_dim)
    answer = torch.zeros(n_queries, n_keys, dtype=torch.bool)
    answer[torch.arange(n_queries), needles] = True
    distractor = torch.zeros(n_keys, dtype=torch.bool)
    distractor[distractors] = True

    def layout(t: Tensor) -> Tensor:
        return t.to(dtype)[None, None].contiguous()

    return RetrievalToy(q=layout(q), q_common=layout(q_common), k=layout(k), v=layout(v), answer=answer,
                        distractor=distractor, context=torch.ones(n_queries, n_keys, dtype=torch.bool),
                        needles=needles)
