"""Samplers and stop strings."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from powerinfer.errors import PowerInferError
from powerinfer.runtime.sampling import (
    Sampler,
    SamplingParams,
    apply_openai_penalties,
    apply_repeat_penalty,
    filter_candidates,
)
from powerinfer.runtime.sequence import StopMatcher

logit_vectors = st.lists(st.floats(-20, 20, allow_nan=False), min_size=2, max_size=60).map(torch.tensor)


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, -2.0, 2.9])
    assert Sampler(SamplingParams(temperature=0))(logits, []) == 1


def test_same_seed_same_tokens():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    sampler = lambda seed: Sampler(SamplingParams(seed=seed, top_k=0, top_p=1.0, min_p=0))  # noqa: E731
    a, b, c = sampler(7), sampler(7), sampler(8)
    first, second, other = ([s(logits, []) for _ in range(50)] for s in (a, b, c))
    assert first == second
    assert first != other


@settings(max_examples=200, deadline=None)
@given(logits=logit_vectors, top_k=st.integers(0, 70), top_p=st.floats(0.01, 1.0), min_p=st.floats(0, 1))
def test_filters_keep_a_sorted_nonempty_prefix_of_the_best_tokens(logits, top_k, top_p, min_p):
    values, ids = filter_candidates(logits, top_k, top_p, min_p)
    assert 1 <= len(ids) <= (top_k or len(logits))
    assert torch.equal(values, logits[ids])
    assert torch.all(values[:-1] >= values[1:])
    assert logits[ids[0]] == logits.max()
    probs = torch.softmax(logits, -1)
    kept = probs[ids]
    assert torch.all(kept >= min_p * probs.max() - 1e-6) or len(ids) == 1
    # top-p: dropping the last kept token would leave less than top_p of the mass
    if top_p < 1 and len(ids) > 1:
        assert kept[:-1].sum() < top_p + 1e-5


@settings(max_examples=100, deadline=None)
@given(logits=logit_vectors, seed=st.integers(0, 1000), temperature=st.floats(0.05, 3))
def test_sampled_token_is_always_a_candidate(logits, seed, temperature):
    params = SamplingParams(temperature=temperature, top_k=5, top_p=0.9, min_p=0.1, seed=seed)
    _, ids = filter_candidates(logits, 5, 0.9, 0.1)
    assert Sampler(params)(logits, []) in ids.tolist()


def test_repeat_penalty_lowers_seen_tokens_only():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_repeat_penalty(logits, [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2), dict(top_k=-3),
                                 dict(repeat_penalty=0)])
def test_bad_parameters_are_rejected(bad):
    with pytest.raises(PowerInferError, match="bad sampling parameter"):
        SamplingParams(**bad)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abcXY\n ", max_size=40),
    stops=st.lists(st.text(alphabet="abcXY\n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
@example(text="YXX", stops=["X", "YXX"], cuts=[2])  # a later-found stop that an earlier one overtakes
def test_stop_matcher_cuts_at_first_stop_however_text_arrives(text, stops, cuts):
    pieces, last = [], 0
    for cut in sorted(cuts) + [len(text)]:
        pieces.append(text[last:cut])
        last = max(last, cut)
    matcher = StopMatcher(stops)
    out = ""
    for piece in pieces:
        out += matcher.push(piece)
        if matcher.stopped:
            break
    if not matcher.stopped:
        out += matcher.flush()
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    assert out == (text[: min(hits)] if hits else text)
    assert matcher.stopped == bool(hits)


def test_stop_matching_is_linear_in_the_text():
    """A 5 MB stop that the text keeps almost completing (matching that copied every prefix per
    token froze the server on it): the text is held back, then cut at the short stop."""
    matcher = StopMatcher(["a" * 5_000_000 + "b", "zz"])
    result: list[str] = []

    def stream() -> None:
        out = "".join(matcher.push("a" * 1000) for _ in range(200))
        result.append(out + matcher.push("zz tail"))

    worker = threading.Thread(target=stream, daemon=True)
    worker.start()
    worker.join(timeout=120)  # a hang detector, not a timing: the quadratic matcher never returns
    assert result == ["a" * 200_000] and matcher.stopped


def test_openai_penalties_bias_and_mask():
    """OpenAI's documented formula: logit - count * frequency - (count > 0) * presence, over the
    generated tokens only; logit_bias is added; masked tokens are never drawn."""
    logits = torch.tensor([1.0, 2.0, 3.0, 0.5])
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: 2.0})
    adjusted = apply_openai_penalties(logits, [2, 2, 1], 0.5, 0.25)
    assert adjusted.tolist() == [1.0, 2.0 - 0.25 - 0.5, 3.0 - 0.5 - 0.5, 0.5]
    # prompt tokens (history beyond `generated`) are not penalized; 3 wins by its bias: 2.5 > 2.0
    assert Sampler(params)(logits, history=[0, 0, 2, 2, 1], generated=[2, 2, 1]) == 3
    allowed = torch.tensor([True, True, False, False])
    assert Sampler(params)(logits, history=[], allowed=allowed) == 1
    with pytest.raises(PowerInferError, match="presence_penalty"):
        SamplingParams(presence_penalty=3)
