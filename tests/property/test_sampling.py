"""Properties of policyworker.functional.sampling (the generation settings as one record)."""

import types

import attrs
from hypothesis import given
from hypothesis import strategies as st

from policyworker.functional.logprobs import sampling_filters_active
from policyworker.functional.sampling import Sampling

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
    assert sampling.as_kwargs() == attrs.asdict(sampling)
    assert attrs.astuple(sampling) == (sampling.temperature, sampling.top_k, sampling.top_p)


@given(SAMPLINGS)
def test_of_generation_reads_a_generation_config(sampling):
    generation = types.SimpleNamespace(**attrs.asdict(sampling), colocated=None)
    assert Sampling.of_generation(generation) == sampling
    assert Sampling.of_generation(None) == Sampling(temperature=1.0, top_k=None, top_p=1.0)
