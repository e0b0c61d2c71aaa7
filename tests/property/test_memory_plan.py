"""Properties of policyworker.functional.memory_plan: phases are sums of their terms, grow with
the tokens, layers and width, and drop the activation terms when there are no tokens."""

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from policyworker.functional.logprobs import default_chunk_size
from policyworker.functional.memory_plan import (
    PHASES,
    MemoryKnobs,
    ModelShape,
    activation_bytes_per_token_layer,
    inference_chunk_tokens,
    largest_fitting,
    plan_memory,
    with_knob,
)


@st.composite
def shapes(draw):
    hidden = draw(st.integers(1, 8192))
    layers = draw(st.integers(0, 96))
    vocab = draw(st.integers(1, 200_000))
    inter = draw(st.integers(1, 4 * 8192))
    kv = draw(st.integers(1, hidden))
    params = 2 * vocab * hidden + layers * (
        2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter
    )
    trainable = draw(st.integers(0, params))
    # at most AdamW's two moments (`optimizer_memory.factored_state_elements`'s bound)
    factored = draw(st.integers(0, 2 * trainable))
    return ModelShape(
        num_params=params,
        num_trainable=trainable,
        num_layers=layers,
        hidden=hidden,
        intermediate=inter,
        vocab=vocab,
        kv_dim=kv,
        largest_tensor=vocab * hidden,
        factored_state_elements=factored,
    )


@st.composite
def knobs(draw):
    return MemoryKnobs(
        train_mb_tokens=draw(st.integers(0, 65536)),
        logprob_mb_tokens=draw(st.integers(0, 65536)),
        logprob_chunk_tokens=draw(st.integers(1, 8192)),
        train_logprob_chunk=draw(st.integers(0, 8192)),
        activation_checkpointing=draw(st.booleans()),
        fused_logprobs=draw(st.booleans()),
        master_bytes=draw(st.sampled_from([2, 4])),
        compute_bytes=draw(st.sampled_from([2, 4])),
        optimizer_states=draw(st.integers(0, 2)),
        factored_optimizer_state=draw(st.booleans()),
        per_tensor_update=draw(st.booleans()),
        optimizer_on_device_for_logprobs=draw(st.booleans()),
        shards=draw(st.integers(1, 8)),
        refit_bucket_bytes=draw(st.integers(0, 2**31)),
        one_pass_refit=draw(st.booleans()),
        top_k=draw(st.integers(0, 64)),
    )


@given(shapes(), knobs())
def test_every_phase_is_the_sum_of_its_nonnegative_terms_and_the_peak_is_the_largest(shape, kn):
    plan = plan_memory(shape, kn)
    assert tuple(p.phase for p in plan.phases) == PHASES
    for p in plan.phases:
        assert all(b >= 0 for _, b in p.terms)
        assert p.total == sum(b for _, b in p.terms)
    assert plan.peak.total == max(p.total for p in plan.phases)


@pytest.mark.parametrize("knob", ["train_mb_tokens", "logprob_mb_tokens", "logprob_chunk_tokens"])
@given(shape=shapes(), kn=knobs(), extra=st.integers(1, 10_000))
def test_every_phase_grows_with_the_microbatch_tokens_and_chunk(knob, shape, kn, extra):
    before = plan_memory(shape, kn)
    after = plan_memory(shape, with_knob(kn, knob, getattr(kn, knob) + extra))
    for a, b in zip(before.phases, after.phases, strict=True):
        assert b.total >= a.total


@pytest.mark.parametrize("field", ["num_layers", "hidden", "intermediate", "vocab", "kv_dim"])
@given(shape=shapes(), kn=knobs(), extra=st.integers(1, 1000))
def test_every_phase_grows_with_the_model_dimensions(field, shape, kn, extra):
    """The parameter count held fixed: the activation and logit terms alone must not shrink.
    (A set chunk: the default one halves as the vocab grows, keeping its block near 128 MiB.)"""
    kn = attrs.evolve(kn, train_logprob_chunk=max(kn.train_logprob_chunk, 1))
    bigger = attrs.evolve(shape, **{field: getattr(shape, field) + extra})
    for a, b in zip(plan_memory(shape, kn).phases, plan_memory(bigger, kn).phases, strict=True):
        if a.phase in ("train_step", "refit", "checkpoint", "optimizer_step"):
            assert b.total >= a.total
    assert activation_bytes_per_token_layer(bigger, kn) >= activation_bytes_per_token_layer(
        shape, kn
    )


@given(shapes(), knobs())
def test_the_default_inference_chunk_is_the_scoring_loops_and_never_past_the_microbatch(shape, kn):
    chunk = inference_chunk_tokens(shape, attrs.evolve(kn, logprob_chunk_tokens=0))
    expected = max(default_chunk_size(shape.vocab), 2048)
    assert chunk == min(expected, kn.logprob_mb_tokens)
    assert inference_chunk_tokens(shape, kn) <= kn.logprob_mb_tokens


@given(shapes(), knobs())
def test_no_tokens_means_no_activation_or_logit_bytes(shape, kn):
    kn = attrs.evolve(kn, train_mb_tokens=0, logprob_mb_tokens=0)
    plan = plan_memory(shape, kn)
    for p in plan.phases:
        terms = dict(p.terms)
        for name in ("activations", "logits", "hidden_states", "logit_chunk"):
            assert terms.get(name, 0) == 0
    train = dict(plan.phase("train_step").terms)
    step = dict(plan.phase("optimizer_step").terms)
    assert train["weights"] == step["weights"] and train["gradients"] == step["gradients"]


@given(shapes(), knobs())
def test_adafactor_never_plans_more_than_adamw_in_any_phase(shape, kn):
    """Its factored state is at most two moments, its per-tensor temporary at most the
    multi-tensor one."""
    adamw = attrs.evolve(
        kn, optimizer_states=2, factored_optimizer_state=False, per_tensor_update=False
    )
    adafactor = attrs.evolve(
        kn, optimizer_states=0, factored_optimizer_state=True, per_tensor_update=True
    )
    for a, b in zip(
        plan_memory(shape, adafactor).phases, plan_memory(shape, adamw).phases, strict=True
    ):
        assert a.total <= b.total, a.phase


@given(shapes(), knobs())
def test_factored_state_counts_only_where_the_knob_says_so(shape, kn):
    dense = attrs.evolve(kn, factored_optimizer_state=False)
    factored = attrs.evolve(kn, factored_optimizer_state=True)
    state = dict(plan_memory(shape, factored).phase("checkpoint").terms)["optimizer_state"]
    without = dict(plan_memory(shape, dense).phase("checkpoint").terms)["optimizer_state"]
    expected = shape.num_trainable * kn.optimizer_states + shape.factored_state_elements
    assert state == -(-expected * kn.master_bytes // kn.shards)
    assert without == -(-shape.num_trainable * kn.optimizer_states * kn.master_bytes // kn.shards)


@given(shapes(), knobs())
def test_activation_checkpointing_never_keeps_more_than_the_full_graph(shape, kn):
    full = dict(
        plan_memory(shape, attrs.evolve(kn, activation_checkpointing=False)).phases[0].terms
    )
    ckpt = dict(plan_memory(shape, attrs.evolve(kn, activation_checkpointing=True)).phases[0].terms)
    assert ckpt["activations"] <= full["activations"]
    if shape.num_layers >= 2 and kn.train_mb_tokens:
        assert ckpt["activations"] < full["activations"]


@given(shapes(), knobs())
def test_one_pass_refit_stages_the_whole_export_and_staged_at_most_that(shape, kn):
    staged = dict(plan_memory(shape, attrs.evolve(kn, one_pass_refit=False)).phase("refit").terms)
    arena = dict(plan_memory(shape, attrs.evolve(kn, one_pass_refit=True)).phase("refit").terms)
    assert staged["staging"] <= arena["staging"]
    assert staged["staging"] <= kn.refit_slots * kn.refit_bucket_bytes


@given(
    slope=st.integers(0, 1000),
    base=st.integers(0, 10**6),
    budget=st.integers(0, 10**7),
    low=st.integers(1, 1000),
    span=st.integers(0, 10**5),
    multiple=st.integers(1, 64),
)
def test_largest_fitting_is_the_largest_multiple_that_fits(
    slope, base, budget, low, span, multiple
):
    def total(x):
        return base + slope * x

    got = largest_fitting(total, budget=budget, low=low, high=low + span, multiple=multiple)
    fits = [x for x in range(low, low + span + 1) if x % multiple == 0 and total(x) <= budget]
    if got is None:
        assert not fits
    else:
        assert got == max(fits)


def test_largest_fitting_refuses_an_empty_range():
    with pytest.raises(ValueError, match="low <= high"):
        largest_fitting(lambda x: x, budget=10, low=5, high=4)


@given(shapes(), knobs())
def test_live_gradients_add_exactly_the_gradient_term_to_the_train_step(shape, kn):
    live = plan_memory(shape, attrs.evolve(kn, grads_in_forward=True)).phase("train_step")
    none = plan_memory(shape, attrs.evolve(kn, grads_in_forward=False)).phase("train_step")
    assert live.total - none.total == dict(live.terms)["gradients"]
    assert dict(none.terms)["gradients"] == 0


@given(shapes(), knobs())
def test_compiled_layers_keep_no_more_than_eager_ones(shape, kn):
    compiled = activation_bytes_per_token_layer(shape, attrs.evolve(kn, compiled_layers=True))
    eager = activation_bytes_per_token_layer(shape, attrs.evolve(kn, compiled_layers=False))
    assert 0 < compiled <= eager


@given(shapes(), knobs())
def test_fused_logprob_kernels_never_need_more_than_eager_ones(shape, kn):
    for phase in ("logprobs", "reference", "topk", "train_step"):
        fused = plan_memory(shape, attrs.evolve(kn, fused_logprobs=True)).phase(phase).total
        eager = plan_memory(shape, attrs.evolve(kn, fused_logprobs=False)).phase(phase).total
        assert fused <= eager, phase
