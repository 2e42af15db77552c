"""The benchmarks' shared statistics (benchmarks/common.py): each repetition's ratio to the run beside it."""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_common", Path(__file__).parents[1] / "benchmarks" / "common.py")
common = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = common  # its dataclasses look their module up there
_spec.loader.exec_module(common)


def test_paired_ratio_takes_each_repetition_against_its_own_base_run() -> None:
    # slow and fast spells move both runs of a repetition: the pairs' ratios are all 2, while the
    # rates themselves spread fourfold
    sparse, dense = [4.0, 1.0, 4.0, 3.0, 2.0], [2.0, 0.5, 2.0, 1.5, 1.0]
    assert common.paired_ratio(sparse, dense) == (2.0, 2.0, 2.0)
    # the median of the ratios (2, 0.5, 2), not the ratio of the medians (4 / 3)
    sparse, dense = [4.0, 2.0, 6.0], [2.0, 4.0, 3.0]
    assert common.paired_ratio(sparse, dense)[0] == 2.0
    assert statistics.median(sparse) / statistics.median(dense) == pytest.approx(4 / 3)


def test_paired_ratio_gives_the_quartiles_of_the_ratios() -> None:
    median, low, high = common.paired_ratio([1.0, 2.0, 3.0, 4.0, 5.0], [1.0] * 5)
    assert (low, median, high) == (2.0, 3.0, 4.0)
    assert common.paired_ratio([1.5], [1.0]) == (1.5, 1.5, 1.5)


def test_paired_ratio_refuses_unpaired_lists() -> None:
    with pytest.raises(ValueError):
        common.paired_ratio([1.0, 2.0], [1.0])


def test_interleaved_alternates_the_order() -> None:
    assert common.interleaved(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert common.interleaved(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert common.interleaved(["a", "b", "c"], 2) == ["a", "b", "c"]
