"""lab.toolkit.step_fit: the fit recovers a known step model, and its flags rebuild it in the twin."""

import pytest

from engine_twin.settings import build_settings
from engine_twin.step_model import StepModel, StepWork, chunk_pairs
from lab.toolkit.step_fit import StepPoint, fit, fit_lower_envelope, flags, residuals

SHAPE = {"params": 7.8e7, "layers": 4, "kv_heads": 4, "head_dim": 64, "dtype_bytes": 4.0}
TRUTH = ["--model-params", "7.8e7", "--model-dtype-bytes", "4", "--num-hidden-layers", "4", "--num-attention-heads",
         "24", "--num-key-value-heads", "4", "--head-dim", "64", "--peak-tflops", "0.05", "--mfu", "1",
         "--hbm-bandwidth-gb-s", "20", "--mbu", "1", "--step-overhead-ms", "15"]


def grid(model: StepModel) -> list[StepPoint]:
    points = []
    for d in (1, 4, 8):
        for c in (128, 1536):
            w = StepWork(d, d * (c + 1), d * c)
            points.append(StepPoint(w.tokens, w.attention_pairs, w.context_tokens, model.seconds(w), f"D={d} C={c}"))
    for p in (256, 1024, 2048):
        w = StepWork(p + 2, chunk_pairs(0, p) + 2 * 140, 2 * 140)
        points.append(StepPoint(w.tokens, w.attention_pairs, w.context_tokens, model.seconds(w), f"P={p}"))
    return points


def settings(argv):
    return build_settings(**{a.lstrip("-").replace("-", "_"): float(b) for a, b in zip(argv[::2], argv[1::2])})


def test_the_fit_recovers_the_twins_own_step_model_and_its_flags_rebuild_it():
    truth = StepModel.from_settings(settings(TRUTH))
    points = grid(truth)
    coef = fit(points)
    assert coef["fixed"] == pytest.approx(truth.fixed_s, rel=1e-6)
    assert coef["tokens"] == pytest.approx(truth.token_s, rel=1e-6)
    assert coef["attention_pairs"] == pytest.approx(truth.pair_s, rel=1e-6)
    assert coef["context_tokens"] == pytest.approx(truth.context_token_s, rel=1e-6)
    step_flags = flags(coef, **SHAPE)
    got = dict(zip(step_flags[::2], step_flags[1::2]))
    assert got["--num-attention-heads"] == "24"
    assert float(got["--peak-tflops"]) == pytest.approx(0.05, rel=1e-4)
    assert float(got["--hbm-bandwidth-gb-s"]) == pytest.approx(20, rel=1e-4)
    assert float(got["--step-overhead-ms"]) == pytest.approx(15, rel=1e-3)
    assert max(abs(r["error"]) for r in residuals(points, step_flags)) < 1e-3


def test_a_coefficient_that_would_be_negative_is_held_at_zero():
    # steps that get shorter with more context (noise): the context term is dropped, not negative
    points = [StepPoint(t, t, ctx, 0.01 + 0.001 * t - 1e-7 * ctx) for t in (1, 4, 16, 64) for ctx in (0, 1000, 5000)]
    coef = fit(points)
    assert coef["context_tokens"] == 0.0
    assert coef["fixed"] > 0 and coef["tokens"] > 0
    step_flags = flags(coef, **SHAPE)
    assert float(dict(zip(step_flags[::2], step_flags[1::2]))["--hbm-bandwidth-gb-s"]) >= 1e5


def test_too_few_points_is_an_error():
    with pytest.raises(ValueError, match="at least 4"):
        fit([StepPoint(1, 1, 1, 0.01)])


def test_the_lower_envelope_drops_steps_other_processes_lengthened():
    truth = StepModel.from_settings(settings(TRUTH))
    clean = grid(truth)
    disturbed = [StepPoint(p.tokens, p.attention_pairs, p.context_tokens, p.seconds * 3, p.label)
                 for p in clean[:2]]
    coef, kept = fit_lower_envelope(disturbed + clean[2:])
    assert not any(p in kept for p in disturbed) and len(kept) == len(clean) - 2
    assert coef["tokens"] == pytest.approx(truth.token_s, rel=1e-6)
    assert coef["fixed"] == pytest.approx(truth.fixed_s, rel=1e-6)
