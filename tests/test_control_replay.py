"""The adaptive controller replayed on every machine measured (cpu-profiles.json) with acceptance from real runs:
it must never make decoding slower than plain by more than 5 %, and must still speculate where speculation pays."""

import statistics

import pytest

import specdecode.control as control
from replay import machines, replay, traces

MACHINES = machines()


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
def test_replayed_controller_is_never_slower_than_plain(machine):
    speedups = {name: replay(machine, trace)["speedup"] for name, trace in traces()}
    worst = min(speedups, key=speedups.get)
    assert speedups[worst] >= 0.95, (worst, speedups[worst])


def test_replayed_controller_speculates_where_it_pays():
    """AVX-512 bf16 with the int4 draft: verifying is nearly free and the draft is cheap (the reference runs)."""
    (machine,) = [m for m in MACHINES if m.name.startswith("avx512_bf16") and "int4" in m.name]
    speedups = [replay(machine, trace)["speedup"] for _, trace in traces()]
    assert statistics.median(speedups) > 1.3 and min(speedups) > 1.1, speedups


def test_the_replay_catches_an_absolute_slope_clamp(monkeypatch):
    """Negative control: the old 50 ms-per-position cap on the pass slope (wide passes looked 3x cheaper than they
    are on AVX2 bf16) must fail the replay."""
    observe = control.PassCostLine.observe

    def clamped(self, positions, seconds):
        observe(self, positions, seconds)
        if self.slope_samples:
            self.slope_samples[-1] = min(self.slope_samples[-1], 0.05)

    monkeypatch.setattr(control.PassCostLine, "observe", clamped)
    worst = min(replay(m, trace)["speedup"] for m in MACHINES if "avx2/torch" in m.name for _, trace in traces())
    assert worst < 0.95
