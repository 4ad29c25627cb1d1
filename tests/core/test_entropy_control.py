import math

import pytest

from groupwise.core.entropy import EntropyControl


def test_adaptive_coefficient_worked_example():
    # c = 0.1, H* = 1.0, δ = 0.04, bounds [0.05, 0.15]; step entropies 2.0, 0.8, 0.9, 0.5, 1.2:
    #   step 1: H = ∞ before it → applied 0;     H = 2.0 > 1 → c = max(0.1 − 0.04, 0.05) = 0.06
    #   step 2: last H 2.0 > 1 → applied 0;       H = 0.8 ≤ 1 → c = 0.06 + 0.04 = 0.10
    #   step 3: last H 0.8 ≤ 1 → applied 0.10;    H = 0.9 → c = 0.14
    #   step 4: applied 0.14;                     H = 0.5 → c = min(0.18, 0.15) = 0.15
    #   step 5: applied 0.15;                     H = 1.2 → c = 0.11
    control = EntropyControl(0.1, adaptive=True, target=1.0, coef_min=0.05, coef_max=0.15, delta=0.04)
    applied, after = [], []
    for h in (2.0, 0.8, 0.9, 0.5, 1.2):
        applied.append(control.applied())
        control.observe(h)
        after.append(control.coef)
    assert applied == pytest.approx([0.0, 0.0, 0.10, 0.14, 0.15], abs=1e-12)
    assert after == pytest.approx([0.06, 0.10, 0.14, 0.15, 0.11], abs=1e-12)
    assert control.enabled


def test_fixed_coefficient_never_moves_and_zero_is_off():
    control = EntropyControl(0.3)
    control.observe(0.0)
    assert control.applied() == 0.3 and control.coef == 0.3 and control.enabled
    assert not EntropyControl(0.0).enabled
    assert EntropyControl(0.0, adaptive=True).enabled  # adapted from 0: it may grow back


def test_state_round_trip_with_no_step_yet():
    control = EntropyControl(0.2, adaptive=True, target=5.0)
    assert control.state_dict() == {"entropy_coef": 0.2, "last_world_entropy": None}  # ∞ is not JSON
    other = EntropyControl(0.2, adaptive=True, target=5.0)
    control.observe(3.0)
    other.load_state_dict(control.state_dict())
    assert (other.coef, other.last_entropy) == (control.coef, 3.0) == (pytest.approx(0.205), 3.0)
    other.load_state_dict({"entropy_coef": 0.1, "last_world_entropy": None})
    assert other.last_entropy == math.inf and other.applied() == 0.0


def test_an_entropy_exactly_at_the_target_counts_as_collapsed():
    # TRL 1.16: H ≤ H* on both sides (the bonus applied, c growing). c = 0.1, H* = 0.5, δ = 0.25 (exact in binary),
    # bounds [0, 1]: H = 0.5 → c = 0.1 + 0.25 = 0.35, and the next step applies 0.35 (with < : 0 applied, c = 0)
    control = EntropyControl(0.1, adaptive=True, target=0.5, coef_min=0.0, coef_max=1.0, delta=0.25)
    control.observe(0.5)
    assert control.coef == pytest.approx(0.35) and control.applied() == pytest.approx(0.35)
