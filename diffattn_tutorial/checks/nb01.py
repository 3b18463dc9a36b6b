"""Checks for ``exercises/01_differential_amplifier.ipynb``: the amplifier's output for inputs given as common mode
and difference, its two gains measured on an amplifier with an output offset, and the common-mode rejection ratio.
The reference is ``diffattn_tutorial.course.toys``."""

from __future__ import annotations

import math
from typing import Callable

import torch

from diffattn_tutorial.checks._core import call, exercise_check, expect, fail, passed, randn
from diffattn_tutorial.checks._helpers import as_numbers
from diffattn_tutorial.course.toys import amplifier_gains, amplifier_output, cmrr_db

__all__ = ["check_amplifier_output", "check_gains", "check_cmrr_db"]

# (gain_plus, gain_minus): matched, slightly and badly mismatched, a gain below one, and an inverting pair
# (both gains negative, so the differential gain is negative too)
_GAINS = [(1.0, 1.0), (2.0, 1.5), (1.0, 0.9), (0.5, 0.8), (3.0, 2.99), (-2.0, -1.5)]


def _wires(v_cm, v_d):
    return v_cm + v_d / 2, v_cm - v_d / 2


@exercise_check(task=1, name="output_from_modes",
                refuses=lambda: {amplifier_output: "the library's amplifier_output (course.toys)"})
def check_amplifier_output(fn: Callable) -> None:
    """``fn(v_cm, v_d, gain_plus=1.0, gain_minus=1.0)``: the amplifier's output for wires that carry the common mode
    ``v_cm`` and the difference ``v_d`` (floats or tensors of one shape) -> a float or tensor of that shape."""
    what = "output_from_modes"
    # mismatched gains first: with matched ones, a swapped subtraction and a swapped split give the same output
    cases = zip([(7,), (3, 11), (2, 5, 4), (9,), (1, 6), (4,)], _GAINS[1:] + _GAINS[:1])
    for i, (shape, (gp, gm)) in enumerate(cases):
        v_cm, v_d = randn(*shape, seed=10 + i), randn(*shape, seed=20 + i)
        v_plus, v_minus = _wires(v_cm, v_d)
        expected = amplifier_output(v_plus, v_minus, gain_plus=gp, gain_minus=gm)
        wrong = {
            "v_cm and v_d are not the wires' voltages: build v+ and v- from the modes first (each wire carries the "
            "common mode and half of the difference, with opposite signs)": amplifier_output(v_cm, v_d, gp, gm),
            "each wire carries the whole difference: v+ - v- must be v_d, so each wire carries half of it":
                amplifier_output(v_cm + v_d, v_cm - v_d, gp, gm),
            "the difference is split with the wrong sign: v_d = v+ - v-, so v+ carries +v_d/2 and v- carries -v_d/2":
                amplifier_output(*_wires(v_cm, -v_d), gp, gm),
            "subtracted in the wrong order: the inverting input v_minus is the one subtracted":
                amplifier_output(v_minus, v_plus, gm, gp),
            "added the inputs: a differential amplifier amplifies their difference": gp * v_plus + gm * v_minus,
            "the gains are swapped: each input has its own gain, g+ for v_plus and g- for v_minus":
                amplifier_output(v_plus, v_minus, gm, gp),
            "the gains are ignored: multiply each input by its own gain": amplifier_output(v_plus, v_minus, 1.0, 1.0),
            "one gain for both inputs: with mismatched gains each input is amplified by its own gain before the "
            "difference, so the common mode no longer cancels exactly": gp * (v_plus - v_minus),
        }
        got = call(fn, v_cm, v_d, gain_plus=gp, gain_minus=gm, what=what)
        expect(got, expected, what=what, wrong=wrong)
        got_default = call(fn, v_cm, v_d, what=f"{what} with the default gains")
        expect(got_default, amplifier_output(v_plus, v_minus), what=f"{what} with the default gains (1.0, 1.0)")
    passed("output_from_modes puts the common mode and half the difference on each wire, then amplifies.")


# (gain_plus, gain_minus, output offset): the amplifiers the learner measures, as black boxes
_AMPLIFIERS = [(g[0], g[1], off) for g, off in zip(_GAINS + [(1.2, 0.4)], [0.0, 0.3, -0.05, 0.0, 0.01, 0.2, -1.0])]


@exercise_check(task=2, name="gains")
def check_gains(fn: Callable) -> None:
    """``fn(amplifier)``: ``amplifier(v_plus, v_minus)`` a linear amplifier (a function of two floats, possibly with
    an output offset) -> ``(differential_gain, common_mode_gain)``, measured on it."""
    what = "gains"
    got_d, got_c, exp_d, exp_c = [], [], [], []
    for gp, gm, off in _AMPLIFIERS:
        res = call(fn, lambda v_plus, v_minus, gp=gp, gm=gm, off=off: gp * v_plus - gm * v_minus + off, what=what)
        if not isinstance(res, (tuple, list)) or len(res) != 2:
            fail(f"{what} should return a pair (differential_gain, common_mode_gain), got {type(res).__name__}")
        got_d.append(res[0])
        got_c.append(res[1])
        ad, acm = amplifier_gains(gp, gm)
        exp_d.append(ad)
        exp_c.append(acm)
    gd, gc = as_numbers(got_d, what=what), as_numbers(got_c, what=what)
    ed, ec = torch.tensor(exp_d, dtype=torch.float64), torch.tensor(exp_c, dtype=torch.float64)
    off = torch.tensor([a[2] for a in _AMPLIFIERS], dtype=torch.float64)
    got = torch.stack([gd, gc], dim=1)
    expected = torch.stack([ed, ec], dim=1)
    expect(got, expected, what=what, wrong={
        "the output offset is counted as gain: these amplifiers output something even for zero input; measure "
        "that first and take it out of both readings": torch.stack([ed + off, ec + off], 1),
        "the offset is taken out of one reading only: it is in every output, so subtract it from both":
            torch.stack([ed + off, ec], 1),
        "the offset is taken out of one reading only (the differential one): it is in every output, so subtract it "
        "from both": torch.stack([ed, ec + off], 1),
        "the pair is in the wrong order: return (differential_gain, common_mode_gain)": torch.stack([ec, ed], 1),
        "the differential gain is not per volt of difference: v_plus = +1, v_minus = -1 is a difference of 2 V, "
        "so the output must be divided by that difference": torch.stack([2 * ed, ec], 1),
        "the common-mode gain has the wrong sign: feed the same voltage to both inputs and read what comes out":
            torch.stack([ed, -ec], 1),
        "the common-mode gain is halved: a common mode of 1 V puts the full 1 V on each input, not half of it":
            torch.stack([ed, ec / 2], 1),
        "the differential gain lost its sign: an amplifier with negative gains inverts, so its differential "
        "gain is negative (do not take an absolute value or clamp)": torch.stack([ed.abs(), ec], 1),
        "the common-mode gain lost its sign: when g- is larger than g+ the common mode comes out inverted, a "
        "negative gain (do not take an absolute value or clamp)": torch.stack([ed, ec.abs()], 1),
    })
    passed("both gains measured on the amplifier itself, its output offset taken out, like a lab would.")


@exercise_check(task=3, name="cmrr_db", refuses=lambda: {cmrr_db: "the library's cmrr_db (course.toys)"})
def check_cmrr_db(fn: Callable) -> None:
    """``fn(differential_gain, common_mode_gain)`` -> the CMRR in decibels (a float; ``math.inf`` for a common-mode
    gain of zero)."""
    what = "cmrr_db"
    # gains of either sign, and a common-mode gain larger than the differential one (a CMRR below 0 dB)
    cases = [(1.0, 0.1), (0.95, 0.1), (1.75, 0.5), (0.65, -0.3), (2.995, 0.01), (100.0, 1.0), (0.8, -0.002),
             (-0.95, 0.1), (0.05, 0.5), (-1.75, -0.5)]
    got = []
    for ad, acm in cases:
        try:
            got.append(fn(ad, acm))
        except NotImplementedError:
            raise
        except ValueError as e:
            if (ad / acm) < 0 and "domain" in str(e):
                fail(f"{what}({ad}, {acm}) raised ValueError (math domain error): the ratio of the gains is negative "
                     f"here, and a logarithm takes only positive numbers. Gains can have either sign; the CMRR "
                     f"compares their sizes (magnitudes)")
            call(fn, ad, acm, what=f"{what}({ad}, {acm})")  # reports the error with its line
        except Exception:  # noqa: BLE001 - reported by call() with the line it happened on
            call(fn, ad, acm, what=f"{what}({ad}, {acm})")
    got = as_numbers(got, what=what)
    expected = torch.tensor([float(cmrr_db(ad, acm)) for ad, acm in cases], dtype=torch.float64)
    ratio = torch.tensor([ad / acm for ad, acm in cases], dtype=torch.float64)
    if torch.isnan(got).any():
        fail(f"{what} returned NaN for gains of opposite signs: the logarithm of a negative ratio is undefined; "
             f"the CMRR compares the sizes (magnitudes) of the gains, whatever their signs")
    expect(got, expected, what=what, wrong={
        "used 10 * log10: that is for power ratios; gains are amplitude ratios, and decibels of an amplitude "
        "ratio take twice that factor": 10 * torch.log10(ratio.abs()),
        "the ratio is upside down: CMRR = differential gain / common-mode gain (bigger is better)":
            20 * torch.log10(1 / ratio.abs()),
        "used the natural log: decibels use the base-10 logarithm": 20 * torch.log(ratio.abs()),
        "returned the plain ratio: convert it to decibels": ratio.abs(),
        "forgot the factor in front of the logarithm: decibels of an amplitude ratio are 20 times its log10":
            torch.log10(ratio.abs()),
        "a CMRR below 0 dB came out positive: when the common-mode gain is larger than the differential gain "
        "the amplifier favours the common mode and the CMRR is negative; do not take the absolute value of the "
        "decibels": 20 * torch.log10(ratio.abs()).abs(),
        "a CMRR below 0 dB came out as 0: when the common-mode gain is larger than the differential gain the "
        "CMRR is negative; do not clamp the decibels": (20 * torch.log10(ratio.abs())).clamp(min=0),
    })
    try:
        perfect = float(cmrr_db(1.0, 0.0))
    except (ZeroDivisionError, ValueError):
        perfect = None
    if perfect is not None and math.isinf(perfect):
        got_perfect = as_numbers([call(fn, 1.0, 0.0, what=f"{what}(1.0, 0.0)")], what=what)[0]
        if not (math.isinf(got_perfect) and got_perfect > 0):
            fail(f"{what}(1.0, 0.0) should be +inf: a perfectly matched amplifier rejects all common mode "
                 f"(handle a common-mode gain of zero before dividing)")
    passed("CMRR = 20 log10 |Ad / Acm| dB.")
