"""The study's metrics on hand-made maps, retrieval_study end to end on tiny budgets, its cache, and the
recorded results that notebook 07 shows (seed 0 re-run and compared)."""

import threading

import pytest
import torch

from diffattn_tutorial import recorded
from diffattn_tutorial.training.cache import cache_lock
from diffattn_tutorial.training.model import ATTENTIONS, AttentionProbe, build_model
from diffattn_tutorial.training.needle import NeedleTask
from diffattn_tutorial.training.study import (
    SUMMARY_KEYS,
    StudyConfig,
    StudyResult,
    accuracy,
    attention_scores,
    cache_dir,
    claim_lines,
    deterministic,
    disagreements,
    logit_outliers,
    measure,
    retrieval_study,
)

TINY = dict(steps=6, batch_size=4, n_eval=8, d_model=32, n_layers=2, n_heads=4, progress=False,
            task=NeedleTask(context_len=12), settings=((1, 1), (4, 2)))


def test_attention_scores_on_hand_made_maps():
    task = NeedleTask(context_len=10)
    b = task.sample(3, 4, 2, generator=torch.Generator().manual_seed(0))
    L = b.tokens.shape[1]
    maps = torch.zeros(3, 2, L, L)
    for i in range(3):
        for r in range(2):
            row = b.query_pos[i, r]
            maps[i, 0, row] = b.answer_mask[i, r].float()  # head 0: all on the answer
            maps[i, 1, row, 1:11] = 0.1  # head 1: uniform over the haystack (one of 10 is the answer)
    probe = AttentionProbe(maps=maps, logits=torch.zeros(3, 2, L, L))
    s = attention_scores([probe], b)
    assert s["answer"].shape == s["noise"].shape == (3, 2, 2)  # (B, H, R)
    torch.testing.assert_close(s["answer"].mean((0, 2)), torch.tensor([1.0, 0.1]))
    torch.testing.assert_close(s["noise"].mean((0, 2)), torch.tensor([0.0, 0.9]))


def test_logit_outliers_ignores_masked_entries():
    logits = torch.tensor([[1.0, float("-inf")], [-2.0, 8.0]])[None, None]
    probe = AttentionProbe(maps=torch.zeros_like(logits), logits=logits)
    assert logit_outliers([probe]) == pytest.approx(8.0 / 2.0)


def test_accuracy_counts_the_answer_after_each_queried_key():
    task = NeedleTask(context_len=8)
    b = task.sample(4, 2, 2, generator=torch.Generator().manual_seed(0))

    class Oracle(torch.nn.Module):
        def forward(self, idx):
            out = torch.zeros(*idx.shape, task.vocab_size)
            return out.scatter(2, b.targets.clamp_min(0)[..., None], 1.0)

    assert accuracy(Oracle(), b) == 1.0
    wrong = b._replace(answers=b.answers.roll(1, 0) + 1)
    assert accuracy(Oracle(), wrong) < 1.0


def test_deterministic_restores_threads():
    before = torch.get_num_threads()
    with deterministic(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("kind", ["baseline", "diff", "diff_v2"])
def test_retrieval_study_tiny_budget(kind):
    r = retrieval_study(kind, seed=3, **TINY)
    for key in ("accuracy", "attn_to_answer", "attn_to_noise", "logit_top1_over_median"):
        assert isinstance(getattr(r.metrics, key), float)
    assert 0 <= r.metrics.accuracy <= 1 and set(r.metrics.accuracy_by_setting) == {"1/1", "4/2"}
    assert len(r.losses) == 6 and r.params == r.model.num_parameters()
    assert r.metrics.logit_top1_over_median >= 1
    assert r.metrics.logit_top1_over_median == pytest.approx(r.metrics.logit_top1 / r.metrics.logit_median)
    assert r.metrics.attn_to_answer == pytest.approx(r.metrics.attn_by_layer[r.metrics.attn_layer][0])
    assert r.metrics.attn_layer == max(range(2), key=lambda i: r.metrics.attn_by_layer[i][0])
    assert len(r.metrics.attn_by_depth) == 5 and (r.metrics.lambdas is None) == (kind != "diff")
    if kind == "baseline":  # softmax shares are probabilities
        assert 0 <= r.metrics.attn_to_answer <= 1 and 0 <= r.metrics.attn_to_noise <= 1
        assert r.metrics.attn_to_answer + r.metrics.attn_to_noise <= 1 + 1e-6


def test_retrieval_study_is_deterministic_and_seeded():
    a = retrieval_study("diff", seed=0, **TINY)
    b = retrieval_study("diff", seed=0, **TINY)
    c = retrieval_study("diff", seed=1, **TINY)
    assert a.losses == b.losses and a.metrics.attn_to_answer == b.metrics.attn_to_answer
    assert a.losses != c.losses
    torch.testing.assert_close(a.eval_batch.tokens, c.eval_batch.tokens)  # same evaluation data


def test_cache_reuses_an_identical_run(tmp_path):
    a = retrieval_study("diff_v2", seed=0, cache=tmp_path, **TINY)
    b = retrieval_study("diff_v2", seed=0, cache=tmp_path, **TINY)
    c = retrieval_study("diff_v2", seed=0, cache=tmp_path, **{**TINY, "steps": 5})
    assert (a.cached, b.cached, c.cached) == (False, True, False)
    assert len(list(tmp_path.glob("*.pt"))) == 2
    assert b.config == a.config and b.metrics == a.metrics and b.losses == a.losses and b.seconds == a.seconds
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "wrong keys"])
def test_a_damaged_cache_entry_is_retrained_and_replaced(tmp_path, damage):
    """A killed process or a full disk can leave a cut-short entry: it is a miss, said once, never a traceback."""
    a = retrieval_study("diff", seed=0, cache=tmp_path, **TINY)
    (entry,) = tmp_path.glob("*.pt")
    data = entry.read_bytes()
    if damage == "wrong keys":
        torch.save({"weights": 1}, entry)
    else:
        entry.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"not a checkpoint" * 50,
                           "empty": b""}[damage])
    with pytest.warns(UserWarning, match="is damaged"):
        b = retrieval_study("diff", seed=0, cache=tmp_path, **TINY)
    assert not b.cached and b.losses == a.losses
    c = retrieval_study("diff", seed=0, cache=tmp_path, **TINY)  # the entry was replaced by a good one
    assert c.cached and c.losses == a.losses


def test_an_unwritable_cache_costs_a_warning_not_the_run(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.warns(UserWarning, match="DIFFATTN_CACHE"):
        r = retrieval_study("baseline", seed=0, cache=blocker / "cache", **TINY)  # a folder under a file
    assert not r.cached and len(r.losses) == TINY["steps"]


def test_retrieval_study_rejects_unknown_attention():
    with pytest.raises(ValueError, match="attention must be one of"):
        retrieval_study("linear", **TINY)
    with pytest.raises(TypeError, match="unexpected keyword argument 'step'"):
        retrieval_study("diff", step=3)  # a misspelt setting is an error, never silently ignored


def test_study_config_names_the_run_and_its_summary_is_the_recorded_row():
    config = StudyConfig("diff", seed=2, settings=[[1, 1], [4, 2]])
    assert config.settings == ((1, 1), (4, 2)) and config.device == "cpu"  # normalised, hashable
    assert config.lm_config().max_len == max(config.task.seq_len(r) for _, r in config.settings)
    key = config.cache_key()
    assert key != StudyConfig("diff", seed=3).cache_key() and key != StudyConfig("diff", lr=1e-3).cache_key()
    r = retrieval_study("diff_v2", seed=1, **TINY)
    row = r.summary()
    assert {"attention", "seed", "steps", "final_loss", "seconds", *SUMMARY_KEYS} == set(row)
    assert (row["attention"], row["seed"], row["steps"]) == ("diff_v2", 1, TINY["steps"])
    assert row["final_loss"] == pytest.approx(sum(r.losses) / len(r.losses))  # fewer than 50 steps: all of them
    assert row["accuracy"] == r.metrics.accuracy and disagreements(r, row) == []


def test_trained_model_generates_with_its_cache():
    r = retrieval_study("baseline", seed=0, **TINY)
    m, b = r.model, r.eval_batch
    prompt = b.tokens[:, :b.query_pos[0, 0] + 1]
    assert torch.equal(m.generate(prompt, 3), m.generate(prompt, 3, cache=None))


def test_build_model_vocab_matches_task():
    task = NeedleTask()
    m = build_model("diff", task.vocab_size)
    assert m.head.out_features == task.vocab_size


# --- the training cache: where it lives and how to switch it off -------------------------------------------

def test_cache_dir_follows_env_and_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("DIFFATTN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "diffattn_tutorial"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "diffattn_tutorial"
    monkeypatch.setenv("DIFFATTN_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.setenv("DIFFATTN_CACHE", "0")
    assert cache_dir() is None


def test_cache_true_uses_the_cache_dir_and_0_switches_it_off(monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFATTN_CACHE", str(tmp_path))
    a = retrieval_study("baseline", seed=0, cache=True, **TINY)
    b = retrieval_study("baseline", seed=0, cache=True, **TINY)
    assert (a.cached, b.cached) == (False, True) and len(list(tmp_path.glob("*.pt"))) == 1
    monkeypatch.setenv("DIFFATTN_CACHE", "0")
    c = retrieval_study("baseline", seed=0, cache=True, **TINY)
    assert not c.cached and c.losses == a.losses and len(list(tmp_path.glob("*.pt"))) == 1


def test_cache_key_includes_the_thread_count(tmp_path):
    retrieval_study("baseline", seed=0, cache=tmp_path, **TINY)
    r = retrieval_study("baseline", seed=0, cache=tmp_path, num_threads=2, **TINY)
    assert not r.cached and len(list(tmp_path.glob("*.pt"))) == 2


def test_a_second_caller_waits_for_the_first_and_loads(tmp_path):
    """Two processes asking for the same run (two notebooks, parallel tests) must not both train it."""
    retrieval_study("diff", seed=0, cache=tmp_path, **TINY)
    (entry,) = tmp_path.glob("*.pt")
    out = {}
    with cache_lock(entry):  # someone else is loading or training this entry
        waiter = threading.Thread(target=lambda: out.update(r=retrieval_study("diff", seed=0, cache=tmp_path, **TINY)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive(), "the second caller did not wait for the lock"
    waiter.join(60)
    assert out["r"].cached


# --- recorded results and what a re-run must reproduce ----------------------------------------------------

def test_disagreements_names_metrics_beyond_tolerance():
    row = {"accuracy": 0.60, "attn_to_answer": 0.20, "attn_to_noise": 0.70, "logit_top1": 20.0, "final_loss": 0.8}
    assert disagreements(dict(row), row) == []
    near = {**row, "accuracy": 0.62, "logit_top1": 21.5}
    assert disagreements(near, row) == []
    far = {**row, "accuracy": 0.65, "logit_top1": 23.0}
    lines = disagreements(far, row)
    assert [line.split(":")[0] for line in lines] == ["accuracy", "logit_top1"]
    assert disagreements({**row, "attn_to_noise": float("nan")}, row)  # NaN never agrees


def test_recorded_results_say_how_they_were_made():
    assert {"seed_study", "budget_study"} <= set(recorded.available())
    studies = [name for name in recorded.available() if name.endswith("_study")]  # tools/record_study.py's files
    for name in studies:
        rec = recorded.load(name)
        assert {"command", "device", "torch", "date", "settings", "rows"} <= set(rec), name
        assert rec["rows"] and all({"attention", "seed", "steps", "lr", *SUMMARY_KEYS} <= set(r) for r in rec["rows"])
    seeds = recorded.load("seed_study")["rows"]
    assert sorted((r["attention"], r["seed"]) for r in seeds) == sorted(
        (k, s) for k in ATTENTIONS for s in range(10))
    with pytest.raises(FileNotFoundError, match="recorded: .*seed_study"):
        recorded.load("no_such_study")


def _seed0(kind: str, num_threads: int = 1) -> StudyResult:
    """Notebook 07's own run of seed 0 (shared with the notebooks through the session's cache)."""
    return retrieval_study(kind, seed=0, cache=True, progress=False, num_threads=num_threads)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ATTENTIONS)
def test_seed0_reproduces_the_recorded_row(kind):
    row = next(r for r in recorded.load("seed_study")["rows"] if r["attention"] == kind and r["seed"] == 0)
    assert disagreements(_seed0(kind), row) == []


def test_kept_claim_lines_hold_for_every_recorded_seed():
    """The lines notebook 07 keeps in its outputs (claim_lines) hold with a margin, not by float luck: another CPU,
    thread count or BLAS build sums in another order, which after 500 steps moves a run about as far as another
    seed does, and the claims hold for every one of the ten recorded seeds. (Seed 0 is re-run live above, so the
    recorded rows are those of today's code.)"""
    rows = recorded.load("seed_study")["rows"]
    seeds = sorted({r["seed"] for r in rows})
    assert len(seeds) >= 10
    for seed in seeds:
        baseline, diff = (next(r for r in rows if r["attention"] == kind and r["seed"] == seed)
                          for kind in ("baseline", "diff"))
        lines = claim_lines(baseline, diff)
        assert lines and all(line.startswith("holds: ") for line in lines), (seed, lines)


def test_a_cached_run_keeps_the_metrics_it_was_measured_with(tmp_path, monkeypatch):
    """A cache hit does not measure again: the entry holds the metrics measured when the run was trained (the key
    names the measuring code and torch), equal to what measuring the loaded model gives. An entry written without
    them (an older version's) is measured once and completed."""
    from diffattn_tutorial.training import study

    a = retrieval_study("diff", seed=0, cache=tmp_path, **TINY)
    (entry,) = tmp_path.glob("*.pt")
    assert torch.load(entry, weights_only=True)["metrics"]["accuracy"] == a.metrics.accuracy
    calls = []
    monkeypatch.setattr(study, "measure", lambda *args: calls.append(1) or measure(*args))
    b = retrieval_study("diff", seed=0, cache=tmp_path, **TINY)
    assert b.cached and calls == [] and b.metrics == a.metrics
    with deterministic(1):
        assert b.metrics == measure(b.model, b.config.task, b.config.settings, b.config.n_eval)[0]
    torch.testing.assert_close(b.eval_batch.tokens, a.eval_batch.tokens)
    old = torch.load(entry, weights_only=True)
    del old["metrics"]
    torch.save(old, entry)
    c = retrieval_study("diff", seed=0, cache=tmp_path, **TINY)
    assert c.cached and calls == [1] and c.metrics == a.metrics
    d = retrieval_study("diff", seed=0, cache=tmp_path, **TINY)
    assert d.cached and calls == [1] and d.metrics == a.metrics
