"""policyworker.nemo_rl: NeMo-RL's names over the core, each equal to the core function it faces."""

import builtins
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyworker.errors import ConfigError, DataError
from policyworker.functional.logprobs import next_token_logprobs
from policyworker.functional.loss import NLLLossFn
from policyworker.functional.packing import pack_into_bins
from policyworker.functional.sampling import sampling_keep_mask
from policyworker.nemo_rl import (
    PackingAlgorithm,
    SequencePacker,
    TrainingSamplingParams,
    apply_top_k_top_p,
    get_next_token_logprobs_from_logits,
    get_packer,
    prepare_loss_input,
)
from policyworker.nemo_rl import config as nemo_config

LENGTHS = st.lists(st.integers(0, 64), max_size=30)


@settings(max_examples=60)
@given(
    lengths=LENGTHS,
    algorithm=st.sampled_from(list(PackingAlgorithm)),
    spelling=st.sampled_from(["enum", "lower", "upper"]),
    capacity=st.integers(64, 200),
)
def test_a_packer_packs_as_pack_into_bins(lengths, algorithm, spelling, capacity):
    name = {"enum": algorithm, "lower": algorithm.name.lower(), "upper": algorithm.name}[spelling]
    packer = get_packer(name, capacity)
    assert isinstance(packer, SequencePacker)
    bins = packer.pack(lengths)
    assert bins == pack_into_bins(lengths, capacity, algorithm=algorithm.value)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)


@settings(max_examples=40)
@given(lengths=st.lists(st.integers(1, 10), min_size=1, max_size=12), least=st.integers(0, 16))
def test_bin_count_constraints_are_met_or_refused_by_name(lengths, least):
    packer = get_packer(PackingAlgorithm.CONCATENATIVE, 100, min_bin_count=least)
    if len(lengths) < max(least, 1):
        with pytest.raises(ValueError, match=f"Cannot create {least} bins with only"):
            packer.pack(lengths)
    else:
        assert len(packer.pack(lengths)) >= least


def test_an_unknown_algorithm_and_bad_counts_are_refused():
    with pytest.raises(ValueError, match="Available algorithms: CONCATENATIVE"):
        get_packer(object(), 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Unknown packing algorithm"):
        get_packer("best_fit", 10)
    with pytest.raises(ValueError, match="min_bin_count must be nonnegative"):
        get_packer("concatenative", 10, min_bin_count=-1)
    with pytest.raises(ValueError, match="bin_count_multiple must be positive"):
        get_packer("concatenative", 10, bin_count_multiple=0)


LOGITS = st.tuples(st.integers(1, 3), st.integers(2, 6), st.integers(2, 9), st.integers(0, 999))


def _logits(shape):
    b, s, v, seed = shape
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, v, generator=gen), torch.randint(0, v, (b, s), generator=gen)


@settings(max_examples=50)
@given(
    shape=LOGITS, top_k=st.sampled_from([None, -1, 1, 2, 5]), top_p=st.sampled_from([1.0, 0.9, 0.5])
)
def test_apply_top_k_top_p_returns_filtered_logits_and_the_keep_mask(shape, top_k, top_p):
    logits, _ = _logits(shape)
    filtered, mask = apply_top_k_top_p(logits, top_k, top_p)
    keep = sampling_keep_mask(logits, top_k=top_k, top_p=top_p)
    if keep is None:
        assert mask is None and filtered is logits
        return
    assert mask is not None and torch.equal(mask, keep)
    assert torch.equal(filtered[mask], logits[mask])
    assert bool(torch.isneginf(filtered[~mask]).all())


@settings(max_examples=50)
@given(shape=LOGITS, top_k=st.sampled_from([None, 2]), top_p=st.sampled_from([1.0, 0.8]))
def test_next_token_logprobs_face_is_the_filtered_log_softmax(shape, top_k, top_p):
    logits, ids = _logits(shape)
    params = TrainingSamplingParams(top_k, top_p, 1.0)  # positional, as NeMo-RL builds it
    got = get_next_token_logprobs_from_logits(ids, logits, sampling_params=params)
    filtered, _ = apply_top_k_top_p(logits[:, :-1].float(), top_k, top_p)
    want = torch.log_softmax(filtered, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(got, want)
    plain = get_next_token_logprobs_from_logits(ids, logits)
    torch.testing.assert_close(plain, next_token_logprobs(logits, ids))


def test_prepare_loss_input_follows_the_input_type_and_zeroes_filtered_tokens():
    logits, ids = _logits((2, 5, 7, 3))
    data = {
        "input_ids": ids,
        "token_mask": torch.ones(2, 5),
        "sample_mask": torch.ones(2),
    }
    loss_input, same = prepare_loss_input(logits, data, NLLLossFn())
    assert same is data
    torch.testing.assert_close(loss_input["next_token_logprobs"], next_token_logprobs(logits, ids))

    class Penalized:
        input_type = NLLLossFn().input_type
        reference_policy_kl_penalty = 0.1

    params = TrainingSamplingParams(top_k=1)
    loss_input, data = prepare_loss_input(logits, data, Penalized(), sampling_params=params)
    lp = loss_input["next_token_logprobs"]
    assert bool(torch.isfinite(lp).all())
    torch.testing.assert_close(data["curr_logprobs_unfiltered"], next_token_logprobs(logits, ids))

    class Raw:
        input_type = "logit"

    assert prepare_loss_input(logits, {}, Raw())[0]["logits"] is logits
    with pytest.raises(NotImplementedError, match="vocab_parallel_group"):
        prepare_loss_input(logits, data, NLLLossFn(), vocab_parallel_group=object())


def test_our_errors_are_what_nemo_rl_raises_and_read_as_written():
    data_error = DataError("missing key 'extra' in batch 1")
    assert isinstance(data_error, KeyError | AssertionError | ValueError)
    assert str(data_error) == "missing key 'extra' in batch 1"
    assert isinstance(ConfigError("x"), AssertionError | ValueError)


def test_load_config_returns_a_dictconfig_with_defaults_merged(tmp_path):
    pytest.importorskip("omegaconf")  # an optional dependency; the refusal is tested below
    (tmp_path / "base.yaml").write_text("a: 1\nb: {c: 2}\nd: ${mul:${a},3}\n")
    (tmp_path / "child.yaml").write_text("defaults: base.yaml\na: 4\n")
    nemo_config.register_omegaconf_resolvers()
    nemo_config.register_omegaconf_resolvers()  # twice is fine
    cfg = nemo_config.load_config(tmp_path / "child.yaml")
    assert type(cfg).__name__ == "DictConfig"
    assert (cfg.a, cfg.b.c, cfg.d) == (4, 2, 12)
    cfg = nemo_config.parse_hydra_overrides(cfg, ["b.c=5", "+e=1"])
    assert (cfg.b.c, cfg.e) == (5, 1)
    with pytest.raises(nemo_config.OverridesError, match="could not override 'zz'"):
        nemo_config.parse_hydra_overrides(cfg, ["zz=1"])


def test_without_omegaconf_the_config_faces_refuse_by_name(monkeypatch, tmp_path):
    real_import = builtins.__import__
    monkeypatch.delitem(sys.modules, "omegaconf", raising=False)

    def no_omegaconf(name, *args, **kwargs):
        if name == "omegaconf" or name.startswith("omegaconf."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_omegaconf)
    monkeypatch.setattr(sys, "path", [])
    for call in (
        nemo_config.register_omegaconf_resolvers,
        lambda: nemo_config.load_config(tmp_path / "x.yaml"),
    ):
        with pytest.raises(ImportError, match="need the omegaconf package"):
            call()


@settings(max_examples=30)
@given(
    given_keys=st.fixed_dictionaries(
        {},
        optional={
            "ratio_clip_min": st.floats(0.01, 0.5),
            "token_level_loss": st.booleans(),
            "reference_policy_kl_penalty": st.floats(0.0, 1.0),
            "some_extra_key": st.integers(),
        },
    )
)
def test_a_loss_config_face_reads_back_given_keys_and_the_core_defaults(given_keys):
    import attrs

    from policyworker.functional.loss_options import ClippedPGConfig
    from policyworker.nemo_rl.loss import ClippedPGLossConfig

    cfg = ClippedPGLossConfig(**given_keys)
    assert dict(cfg) == given_keys
    for field in attrs.fields(ClippedPGConfig):
        want = given_keys.get(field.name, field.default)
        assert getattr(cfg, field.name) == want
    with pytest.raises(AttributeError, match="has no key 'nope'"):
        _ = cfg.nope


def test_a_loss_config_face_is_checked_when_the_loss_is_built_as_in_nemo_rl():
    from policyworker.nemo_rl.loss import ClippedPGLossConfig, ClippedPGLossFn

    cfg = ClippedPGLossConfig(use_cispo=True, ratio_clip_c=3.0)  # no check yet
    with pytest.raises(AssertionError, match="use_cispo cannot be combined with ratio_clip_c"):
        ClippedPGLossFn(cfg)
    assert ClippedPGLossFn(ClippedPGLossConfig()).cfg == ClippedPGLossFn().cfg


@settings(max_examples=30)
@given(seed=st.integers(0, 999), rows=st.integers(1, 4), length=st.integers(2, 6))
def test_a_loss_face_called_positionally_equals_the_keyword_call(seed, rows, length):
    from policyworker.nemo_rl.loss import NLLLossFn as FaceNLL

    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(rows, length - 1, generator=g)
    data = {"token_mask": torch.ones(rows, length), "sample_mask": torch.ones(rows)}
    gvs, gvt = torch.tensor(float(rows)), torch.tensor(float(rows * (length - 1)))
    positional = FaceNLL()(lp, data, gvs, gvt)
    keyword = NLLLossFn()(
        data=data, global_valid_seqs=gvs, global_valid_toks=gvt, next_token_logprobs=lp
    )
    assert torch.equal(positional[0], keyword[0]) and positional[1] == keyword[1]
    assert FaceNLL()(data, gvs, gvt, next_token_logprobs=lp)[1] == keyword[1]
    with pytest.raises(TypeError, match="at most 4 positional arguments"):
        FaceNLL()(lp, data, gvs, gvt, 1)
