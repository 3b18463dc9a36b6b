"""The notebook-09 checks catch real mistakes: each check runs a learner's @triton.jit device function in
Triton's interpreter; plausible wrong kernels fail with the hint that names the mistake, a right one passes,
a stub counts as not attempted and a crash becomes a hint."""


import pytest  # noqa: E402
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from diffattn_tutorial import checks  # noqa: E402
from diffattn_tutorial.checks import CheckFailed  # noqa: E402

pytestmark = [
    # interpreter mode is process-wide; on a GPU the session tests compiled kernels
    pytest.mark.skipif(torch.cuda.is_available(), reason="the notebook-09 checks run kernels in Triton's "
                       "interpreter; the CPU run covers them"),
    pytest.mark.filterwarnings("ignore:(invalid value|divide by zero) encountered:RuntimeWarning"),
]


@pytest.fixture(autouse=True, scope="module")
def _interpreted():
    """The checks need Triton's interpreter, which ``tests/conftest.py`` switches on before triton is imported."""
    if type(tl.sum).__name__ != "InterpretedFunction":
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set in this test session", pytrace=False)


def fails(check, fn, match: str) -> None:
    with pytest.raises(CheckFailed, match=match):
        check(fn)


# ---------------------------------------------------------------- right answers (as in solutions/09)


@triton.jit
def step_right(m, l, acc, s, v):
    s = tl.trans(s)  # the harness gives the tile keys by queries: back to queries by keys
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    alpha = tl.math.exp2(m - m_ref)
    p = tl.math.exp2(s - m_ref[:, None])
    l_new = l * alpha + tl.sum(p, 1)
    acc_new = acc * alpha[:, None] + tl.dot(p, v)
    return m_new, l_new, acc_new


@triton.jit
def combine_right(acc1, l1, acc2, l2, lam):
    o1 = acc1 / tl.where(l1 == 0.0, 1.0, l1)[:, None]
    o2 = acc2 / tl.where(l2 == 0.0, 1.0, l2)[:, None]
    return o1 - lam[:, None] * o2


@triton.jit
def grads_right(p1, p2, dp, delta1, delta2, lam):
    ds1 = p1 * (dp - delta1[:, None])
    ds2 = -lam[:, None] * p2 * (dp - delta2[:, None])
    return ds1, ds2


def test_right_answers_pass(capsys):
    checks.check_online_softmax_step(step_right)
    checks.check_diff_combine(combine_right)
    checks.check_diff_softmax_grads(grads_right)
    out = capsys.readouterr().out
    assert out.count("PASSED: ") == 3 and out.count("\n") == 3


def test_checks_leave_the_rng_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    checks.check_diff_combine(combine_right)
    assert torch.equal(before, torch.random.get_rng_state())


# ---------------------------------------------------------------- stubs, crashes, missing decorator


@triton.jit
def step_stub(m, l, acc, s, v):
    raise NotImplementedError("write this")


@triton.jit
def combine_stub(acc1, l1, acc2, l2, lam):
    raise NotImplementedError("write this")


@triton.jit
def grads_stub(p1, p2, dp, delta1, delta2, lam):
    raise NotImplementedError("write this")


@pytest.mark.parametrize("check,stub", [("check_online_softmax_step", step_stub),
                                        ("check_diff_combine", combine_stub),
                                        ("check_diff_softmax_grads", grads_stub)])
def test_stub_is_not_attempted(check, stub):
    with pytest.raises(checks.NotAttempted, match=r"TASK \d not attempted yet"):
        getattr(checks, check)(stub)


@triton.jit
def combine_crash(acc1, l1, acc2, l2, lam):
    return tl.reshape(acc1, (3, 5))  # the wrong number of elements: the interpreter raises


def test_crash_is_a_hint():
    fails(checks.check_diff_combine, combine_crash, "diff_combine raised")


def test_missing_decorator():
    def plain(m, l, acc, s, v):
        return m, l, acc

    fails(checks.check_online_softmax_step, plain, "@triton.jit")


# ---------------------------------------------------------------- TASK 1 mistakes


@triton.jit
def step_natural_exp(m, l, acc, s, v):
    s = tl.trans(s)  # the harness gives the tile keys by queries: back to queries by keys
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v)


@triton.jit
def step_no_rescale(m, l, acc, s, v):
    s = tl.trans(s)  # the harness gives the tile keys by queries: back to queries by keys
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    return m_new, l + tl.sum(p, 1), acc + tl.dot(p, v)


@triton.jit
def step_no_rescale_acc(m, l, acc, s, v):
    s = tl.trans(s)  # the harness gives the tile keys by queries: back to queries by keys
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    return m_new, l * alpha + tl.sum(p, 1), acc + tl.dot(p, v)


@triton.jit
def step_no_rescale_l(m, l, acc, s, v):
    s = tl.trans(s)  # the harness gives the tile keys by queries: back to queries by keys
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    return m_new, l + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v)


@triton.jit
def step_tile_max(m, l, acc, s, v):
    s = tl.trans(s)  # the harness gives the tile keys by queries: back to queries by keys
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - tl.max(s, 1)[:, None])
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v)


@triton.jit
def step_inverted_alpha(m, l, acc, s, v):
    s = tl.trans(s)  # the harness gives the tile keys by queries: back to queries by keys
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.math.exp2(m_new - m)
    p = tl.math.exp2(s - m_new[:, None])
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v)


@triton.jit
def step_wrong_order(m, l, acc, s, v):
    s = tl.trans(s)  # the harness gives the tile keys by queries: back to queries by keys
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    return m_new, acc * alpha[:, None] + tl.dot(p, v), l * alpha + tl.sum(p, 1)


@triton.jit
def step_no_guard(m, l, acc, s, v):  # right on every row that sees a key in its first tile
    s = tl.trans(s)  # the harness gives the tile keys by queries: back to queries by keys
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v)


@triton.jit
def step_zero_reference(m, l, acc, s, v):  # exact in real numbers, but exp2 of scores near -220 underflows
    s = tl.trans(s)  # the harness gives the tile keys by queries: back to queries by keys
    m_new = tl.maximum(tl.maximum(m, tl.max(s, 1)), 0.0)
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v)


@triton.jit
def step_min_reference(m, l, acc, s, v):  # the smallest visible score as the reference: exp2 overflows
    s = tl.trans(s)  # the harness gives the tile keys by queries: back to queries by keys
    low = tl.min(tl.where(s == float("-inf"), float("inf"), s), 1)  # +inf where the tile shows no key
    low = tl.where(low == float("inf"), float("-inf"), low)
    m_new = tl.where(m == float("-inf"), low, tl.where(low == float("-inf"), m, tl.minimum(m, low)))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_ref)
    p = tl.math.exp2(s - m_ref[:, None])
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v)


@triton.jit
def step_running_max_of_tile(m, l, acc, s, v):  # the tile's max replaces the running max
    s = tl.trans(s)  # the harness gives the tile keys by queries: back to queries by keys
    m_new = tl.max(s, 1)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_ref)
    p = tl.math.exp2(s - m_ref[:, None])
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v)


@triton.jit
def step_untransposed(m, l, acc, s_t, v):  # right everywhere but the dot: the weights meet v keys by queries
    m_new = tl.maximum(m, tl.max(s_t, 0))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_ref)
    p_t = tl.math.exp2(s_t - m_ref[None, :])
    return m_new, l * alpha + tl.sum(p_t, 0), acc * alpha[:, None] + tl.dot(p_t, v)


@triton.jit
def step_transposed_right(m, l, acc, s_t, v):  # the solution's form: no transpose back, reductions on axis 0
    m_new = tl.maximum(m, tl.max(s_t, 0))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_ref)
    p_t = tl.math.exp2(s_t - m_ref[None, :])
    return m_new, l * alpha + tl.sum(p_t, 0), acc * alpha[:, None] + tl.dot(tl.trans(p_t), v)


def test_the_transposed_form_passes(capsys):
    checks.check_online_softmax_step(step_transposed_right)
    assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize("fn,match", [
    (step_running_max_of_tile, "not the running max"),
    (step_untransposed, "untransposed|raised"),
    (step_no_guard, "first key tiles are entirely masked.*finite reference"),
    (step_zero_reference, "far below 0.*underflowed"),
    (step_min_reference, "overflowed|span about 300|not the running max"),  # its m is the smallest score
    (step_natural_exp, "natural exponential"),
    (step_no_rescale, "never rescaled"),
    (step_no_rescale_acc, "accumulator is not rescaled"),
    (step_no_rescale_l, "running sum is not rescaled"),
    (step_tile_max, "own max"),
    (step_inverted_alpha, "NaN"),
    (step_wrong_order, "raised"),
])
def test_online_softmax_step_mistakes(fn, match):
    fails(checks.check_online_softmax_step, fn, match)


# ---------------------------------------------------------------- TASK 2 mistakes


@triton.jit
def combine_no_lambda(acc1, l1, acc2, l2, lam):
    return combine_right(acc1, l1, acc2, l2, lam * 0.0 + 1.0)


@triton.jit
def combine_plus(acc1, l1, acc2, l2, lam):
    return combine_right(acc1, l1, acc2, l2, -lam)


@triton.jit
def combine_lam_on_map1(acc1, l1, acc2, l2, lam):
    o1 = acc1 / tl.where(l1 == 0.0, 1.0, l1)[:, None]
    o2 = acc2 / tl.where(l2 == 0.0, 1.0, l2)[:, None]
    return lam[:, None] * o1 - o2


@triton.jit
def combine_unnormalised(acc1, l1, acc2, l2, lam):
    return acc1 - lam[:, None] * acc2


@triton.jit
def combine_one_denominator(acc1, l1, acc2, l2, lam):
    return (acc1 - lam[:, None] * acc2) / tl.where(l1 == 0.0, 1.0, l1)[:, None]


@triton.jit
def combine_swapped(acc1, l1, acc2, l2, lam):
    return combine_right(acc1, l2, acc2, l1, lam)


@triton.jit
def combine_nan_rows(acc1, l1, acc2, l2, lam):
    return acc1 / l1[:, None] - lam[:, None] * acc2 / l2[:, None]


@triton.jit
def combine_lam_columns(acc1, l1, acc2, l2, lam):
    o1 = acc1 / tl.where(l1 == 0.0, 1.0, l1)[:, None]
    o2 = acc2 / tl.where(l2 == 0.0, 1.0, l2)[:, None]
    return o1 - lam[None, :] * o2


@triton.jit
def combine_abs_lambda(acc1, l1, acc2, l2, lam):
    return combine_right(acc1, l1, acc2, l2, tl.abs(lam))


@pytest.mark.parametrize("fn,match", [
    (combine_abs_lambda, "lambda lost its sign"),
    (combine_no_lambda, "lambda is missing"),
    (combine_plus, "sign is flipped"),
    (combine_lam_on_map1, "wrong map"),
    (combine_unnormalised, "not normalised"),
    (combine_one_denominator, "divided by map 1's running sum"),
    (combine_swapped, "swapped"),
    (combine_nan_rows, "see no key"),
    (combine_lam_columns, "along the columns"),
])
def test_diff_combine_mistakes(fn, match):
    fails(checks.check_diff_combine, fn, match)


# ---------------------------------------------------------------- TASK 3 mistakes


@triton.jit
def grads_plus(p1, p2, dp, delta1, delta2, lam):
    return grads_right(p1, p2, dp, delta1, delta2, -lam)


@triton.jit
def grads_no_lambda(p1, p2, dp, delta1, delta2, lam):
    return p1 * (dp - delta1[:, None]), -p2 * (dp - delta2[:, None])


@triton.jit
def grads_delta1_twice(p1, p2, dp, delta1, delta2, lam):
    return grads_right(p1, p2, dp, delta1, delta1, lam)


@triton.jit
def grads_no_delta(p1, p2, dp, delta1, delta2, lam):
    return p1 * dp, -lam[:, None] * p2 * dp


@triton.jit
def grads_d2_without_lambda(p1, p2, dp, delta1, delta2, lam):
    return p1 * (dp - delta1[:, None]), p2 * (-lam[:, None] * dp - delta2[:, None])


@triton.jit
def grads_swapped(p1, p2, dp, delta1, delta2, lam):
    ds1, ds2 = grads_right(p1, p2, dp, delta1, delta2, lam)
    return ds2, ds1


@triton.jit
def grads_no_minus_lambda(p1, p2, dp, delta1, delta2, lam):  # map 2 treated like map 1
    return p1 * (dp - delta1[:, None]), p2 * (dp - delta2[:, None])


@triton.jit
def grads_lambda_clamped(p1, p2, dp, delta1, delta2, lam):
    return grads_right(p1, p2, dp, delta1, delta2, tl.maximum(lam, 0.0))


@pytest.mark.parametrize("fn,match", [
    (grads_no_minus_lambda, "factor -lambda is missing"),
    (grads_lambda_clamped, "lambda was clamped"),
    (grads_plus, "sign of ds2"),
    (grads_no_lambda, "lambda is missing"),
    (grads_delta1_twice, "uses delta1"),
    (grads_no_delta, "not subtracted"),
    (grads_d2_without_lambda, "also carries -lam"),
    (grads_swapped, "swapped"),
])
def test_diff_softmax_grads_mistakes(fn, match):
    fails(checks.check_diff_softmax_grads, fn, match)
