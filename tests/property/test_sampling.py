"""Properties of policyworker.functional.sampling (the generation settings as one record)."""

import math
import types

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from policyworker.functional.logprobs import next_token_logprobs
from policyworker.functional.sampling import Sampling, sampling_filters_active

SAMPLINGS = st.builds(
    Sampling,
    temperature=st.floats(0.1, 4.0),
    top_k=st.one_of(st.none(), st.integers(-1, 50)),
    top_p=st.floats(0.05, 1.0),
)


@given(SAMPLINGS)
def test_unfiltered_keeps_the_temperature_and_turns_every_filter_off(sampling):
    plain = sampling.unfiltered()
    assert plain.temperature == sampling.temperature and not plain.filters_active
    assert plain.unfiltered() == plain
    assert sampling.filters_active == sampling_filters_active(sampling.top_k, sampling.top_p)
    assert attrs.astuple(sampling) == (sampling.temperature, sampling.top_k, sampling.top_p)


@given(SAMPLINGS)
def test_of_generation_reads_a_generation_config(sampling):
    generation = types.SimpleNamespace(**attrs.asdict(sampling), colocated=None)
    assert Sampling.of_generation(generation) == sampling
    assert Sampling.of_generation(None) == Sampling(temperature=1.0, top_k=None, top_p=1.0)


@given(
    temperature=st.floats(allow_nan=True, allow_infinity=True),
    top_k=st.one_of(st.none(), st.integers(-5, 50)),
    top_p=st.floats(-1.0, 2.0),
)
def test_sampling_accepts_exactly_the_valid_settings(temperature, top_k, top_p):
    """Valid: finite temperature > 0, top_k None or >= -1, top_p in (0, 1]; else the first
    offending key is named with its value."""
    temperature_ok = math.isfinite(temperature) and temperature > 0.0
    top_k_ok = top_k is None or top_k >= -1
    top_p_ok = 0.0 < top_p <= 1.0
    if temperature_ok and top_k_ok and top_p_ok:
        assert Sampling(temperature=temperature, top_k=top_k, top_p=top_p).top_p == top_p
        return
    bad_key = "temperature" if not temperature_ok else "top_k" if not top_k_ok else "top_p"
    with pytest.raises(ValueError, match=rf"^{bad_key} \S+ must be "):
        Sampling(temperature=temperature, top_k=top_k, top_p=top_p)


@given(sampling=SAMPLINGS, seed=st.integers(0, 2**31 - 1))
def test_disabled_top_k_spellings_filter_alike(sampling, seed):
    """top_k None, 0 and -1 all mean "off": the same logprobs for any logits."""
    logits = torch.randn(2, 4, 9, generator=torch.Generator().manual_seed(seed))
    ids = torch.randint(0, 9, (2, 4), generator=torch.Generator().manual_seed(seed + 1))
    results = [
        next_token_logprobs(logits, ids, sampling=attrs.evolve(sampling, top_k=off))
        for off in (None, 0, -1)
    ]
    for other in results[1:]:
        assert torch.equal(other, results[0])
