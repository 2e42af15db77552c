"""The measured pay-off of channel runs (powerinfer/sparse/payoff.py): a site gets thresholds only
from the sparsity at which its shape's runs beat its rows, each shape measured once."""

from __future__ import annotations

import pytest

from powerinfer.ops.quant import T
from powerinfer.sparse import payoff
from powerinfer.sparse.payoff import NEVER, PAYOFF_MARGIN, BreakEven, LinearShape, break_even_of, measured_break_even

QKV = LinearShape(64, ((T.Q4_0, 64), (T.Q4_0, 32), (T.Q4_0, 32)))
DOWN = LinearShape(256, ((T.Q4_K, 256),))


def test_a_site_pays_from_its_shapes_break_even_measured_once():
    measured = []

    def measure(shape: LinearShape, working_set: int) -> float:
        measured.append(shape)
        return {QKV: 0.4, DOWN: NEVER}[shape]

    gate = BreakEven(measure)
    assert not gate.pays(QKV, 0.3)
    assert gate.pays(QKV, 0.4) and gate.pays(QKV, 0.7)
    assert not gate.pays(DOWN, 0.9)
    assert measured == [QKV, DOWN]  # each shape timed once, whatever the number of sites


def test_the_break_even_is_where_the_speedup_crosses_the_margin():
    """A win within a timing's noise is no win; between two steps the crossing is interpolated."""
    speedups = {0.1: 0.8, 0.2: 1.0, 0.3: PAYOFF_MARGIN - 0.05, 0.4: PAYOFF_MARGIN + 0.05}
    assert break_even_of(lambda sparsity: speedups.get(sparsity, 2.0)) == pytest.approx(0.35)
    assert break_even_of(lambda sparsity: PAYOFF_MARGIN) == 0.1  # the first step: nothing before it to interpolate
    assert break_even_of(lambda sparsity: PAYOFF_MARGIN * 0.99) == NEVER
    assert PAYOFF_MARGIN > 1.0


def test_nothing_skipped_never_pays():
    assert not BreakEven(lambda shape, working_set: 0.0).pays(QKV, 0.0)


@pytest.mark.parametrize("shape", [QKV, DOWN])
def test_the_measurement_runs_both_layouts_and_names_a_step(shape):
    """Which step wins depends on the machine; that it is one of the steps (or never) does not."""
    assert 0.0 < measured_break_even(shape) <= NEVER


def test_row_bytes_count_every_fused_matrix():
    assert QKV.row_bytes == 128 * 64 // 32 * 18


def test_the_decode_speedup_is_the_median_of_turns_taken_both_ways(monkeypatch):
    """Each round times both models, the first alternating (ABBA), and its ratio counts: the rounds'
    median, so that one spell of the shared memory cannot decide."""
    sparse, dense = object(), object()
    calls = []
    rates = {sparse: iter([9.0, 20.0, 30.0, 20.0, 20.0]), dense: iter([9.0, 10.0, 10.0, 10.0, 40.0])}

    def rate(llm, prompt, n_gen):
        calls.append((llm, n_gen))
        return next(rates[llm])

    monkeypatch.setattr(payoff, "decode_rate", rate)
    assert payoff.decode_speedup(sparse, dense, [1, 2], rounds=4, n_gen=16, progress=False) == pytest.approx(2.0)
    # warm-up steps, then sparse first, dense first, sparse first, dense first
    assert calls == [(sparse, 2), (dense, 2), (sparse, 16), (dense, 16), (dense, 16), (sparse, 16),
                     (sparse, 16), (dense, 16), (dense, 16), (sparse, 16)]
