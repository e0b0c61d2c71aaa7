"""Refits in flight into a real vLLM engine (CPU, fp32), driven through the trainer-side adapter
``VllmInflightRefit``: the trainer streams into the worker's staging while the engine keeps
stepping; the swap is one ``collective_rpc`` between two engine steps.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so this test decides
which steps run before and after the swap; the worker's receiving thread runs beside them. Every
generated token's version (``token_versions``) is checked against the HF logprobs of that
version.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from tests.engines.vllm_helpers import (
    ENGINE_ENV,
    PROMPTS,
    TINY_LLAMA,
    hf_continuation,
    require_vllm,
    tiny_model,
)

require_vllm()

from policyworker.demo.options import VLLM_FP32_TOLERANCE  # noqa: E402
from policyworker.shell.engines.vllm import engine_kwargs  # noqa: E402
from policyworker.shell.engines.vllm_inflight import VllmInflightRefit  # noqa: E402
from policyworker.shell.refit.sender import RefitSender  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("vllm_inflight") / "model"
    tiny_model(LlamaConfig(**TINY_LLAMA), seed=0).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def llm(model_dir):
    from vllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        for key, value in {**ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
            mp.setenv(key, value)
        engine = LLM(
            model=model_dir,
            dtype="float32",
            enforce_eager=True,
            max_model_len=64,
            skip_tokenizer_init=True,
            seed=0,
            max_num_seqs=32,
            block_size=32,  # the CPU default (128) is longer than any prompt: nothing cached
            **engine_kwargs(),
        )
        try:
            yield engine
        finally:
            engine.llm_engine.engine_core.shutdown()


def _model(model_dir, seed):
    from transformers import AutoConfig

    return tiny_model(AutoConfig.from_pretrained(model_dir), seed)


@contextlib.contextmanager
def _inflight(llm, model):
    sender = RefitSender(lambda: model, torch.float32)
    refit = VllmInflightRefit(llm, sender, timeout_s=30.0)
    try:
        yield refit
    finally:
        refit.close()
        sender.close()


def _add_requests(
    llm, tag, max_tokens, prompt=lambda ids: {"prompt_token_ids": list(ids)}, prompts=PROMPTS
):
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=0, detokenize=False, ignore_eos=True
    )
    for i, ids in enumerate(prompts):
        llm.llm_engine.add_request(f"{tag}{i}", prompt(ids), params)


def _run_to_end(llm, results):
    while llm.llm_engine.has_unfinished_requests():
        for out in llm.llm_engine.step():
            if out.finished:
                completion = out.outputs[0]
                ids = list(completion.token_ids)
                lps = [d[t].logprob for d, t in zip(completion.logprobs, ids, strict=True)]
                results[out.request_id] = (ids, lps)


def _cut(refit, rid, n, *, added, finished):
    """Where the request's tokens turn from the previous version to the new one."""
    versions = refit.token_versions(rid, n, added=added, finished=finished)
    cut = versions.index(finished) if finished in versions else n
    assert versions == [added] * cut + [finished] * (n - cut), versions
    return cut


def _assert_old_then_new(refit, tag, results, old, new, *, min_cut=0):
    """Each request's tokens before its swap are `old`'s, from the swap on `new`'s (exactly:
    their logprobs recomputed under each version), the cut at `min_cut` tokens or later."""
    for i, prompt in enumerate(PROMPTS):
        ids, lps = results[f"{tag}{i}"]
        cut = _cut(refit, f"{tag}{i}", len(ids), added=0, finished=1)
        assert cut >= min_cut
        _assert_tokens_of(old, prompt, ids, lps, 0, cut, same=True)
        _assert_tokens_of(new, prompt, ids, lps, cut, len(ids), same=True)


def _refit_while_stepping(llm, refit, steps_before=3):
    """Step the engine while the refit streams (from its own thread); the steps taken during
    the transfer."""
    box = {}

    def send():
        try:
            box["report"] = refit.stage(buffer_size_bytes=1 << 16)
        except Exception as exc:  # surfaced below
            box["error"] = exc

    for _ in range(steps_before):
        llm.llm_engine.step()
    thread = threading.Thread(target=send)
    thread.start()
    stepped = 0
    while thread.is_alive():
        llm.llm_engine.step()  # generation goes on during the transfer
        stepped += 1
        thread.join(0.001)
    return box, stepped


def _assert_tokens_of(model, prompt, ids, lps, start, stop, *, same: bool):
    _, hf = hf_continuation(model, prompt, ids)
    got, want = torch.tensor(lps[start:stop]), torch.tensor(hf[start:stop])
    if same:
        torch.testing.assert_close(got, want, rtol=0, atol=VLLM_FP32_TOLERANCE)
    else:
        assert bool(((got - want).abs() > 1e-3).all()), (got, want)


@pytest.mark.parametrize("kv", ["kept", "recomputed"])
def test_refit_during_generation_swaps_between_engine_steps(llm, model_dir, kv):
    old, new = _model(model_dir, 31), _model(model_dir, 32)
    with _inflight(llm, old) as refit:  # the old weights, before any request
        box, _ = _refit_while_stepping(llm, refit, steps_before=0)
        assert refit.swap()["version"] == 1
    with _inflight(llm, new) as refit:
        tag, results = f"{kv}-", {}
        _add_requests(llm, tag, max_tokens=40)
        box, stepped = _refit_while_stepping(llm, refit)
        assert "error" not in box, box
        assert stepped >= 1  # the engine stepped while the transfer ran
        reply = refit.swap(recompute_kv=kv == "recomputed")
        assert reply["swapped"]["version"] == 1 and reply["failures"] == 0
        _run_to_end(llm, results)
    for i, prompt in enumerate(PROMPTS):
        ids, lps = results[f"{tag}{i}"]
        cut = _cut(refit, f"{tag}{i}", len(ids), added=0, finished=1)
        assert cut == 3 + stepped  # one token per step: prefill, then decode steps
        _assert_tokens_of(old, prompt, ids, lps, 0, cut, same=True)
        if kv == "recomputed":  # new weights over a recomputed cache: the new version exactly
            _assert_tokens_of(new, prompt, ids, lps, cut, len(ids), same=True)
        else:  # new weights over the old version's cache: neither version's full recompute
            _assert_tokens_of(old, prompt, ids, lps, cut, len(ids), same=False)


def test_a_refit_killed_midway_keeps_the_engine_generating_on_the_previous_version(llm, model_dir):
    old, new = _model(model_dir, 41), _model(model_dir, 42)
    with _inflight(llm, old) as refit:
        _refit_while_stepping(llm, refit, steps_before=0)
        refit.swap()
    with _inflight(llm, new) as refit:
        sender = refit.sender
        original = sender._zmq().stream

        def failing_stream(specs, plan, sources, **kwargs):
            def sources_then_fail():
                for _ in range(4):
                    yield next(sources)
                raise OSError("trainer killed mid-refit")

            kwargs["plain"] = None  # read the tensors through the failing sources

            return original(specs, plan, sources_then_fail(), **kwargs)

        sender._zmq().stream = failing_stream
        tag, results = "killed-", {}
        _add_requests(llm, tag, max_tokens=30)
        box, _ = _refit_while_stepping(llm, refit)
        assert isinstance(box.get("error"), OSError)
        for _ in range(100):  # the worker's thread notices the abort within a few steps
            reply = refit.swap()
            if reply["failures"]:
                break
            llm.llm_engine.step()
        assert reply["failures"] == 1 and reply["swapped"] is None and reply["version"] == 0
        sender._zmq().stream = original
        box, _ = _refit_while_stepping(llm, refit, steps_before=1)
        assert "error" not in box, box
        reply = refit.swap(recompute_kv=True)
        assert reply["swapped"]["version"] == 1
        _run_to_end(llm, results)
    _assert_old_then_new(refit, tag, results, old, new)


def _worker_weights(worker):
    return worker._policyworker_receiver


def _embedding_ptr(worker):
    model = worker.model_runner.get_model()
    return next(model.parameters()).data_ptr()


def test_consecutive_swaps_exchange_a_shadow_whose_storage_alternates_with_the_live_one(
    llm, model_dir
):
    versions = [_model(model_dir, seed) for seed in (51, 52, 53)]
    ptrs = [llm.collective_rpc(_embedding_ptr)[0]]
    for n, model in enumerate(versions, start=1):
        with _inflight(llm, model) as refit:
            assert llm.collective_rpc(lambda w: _worker_weights(w).mode)[0] == "shadow"
            box, _ = _refit_while_stepping(llm, refit, steps_before=0)
            assert "error" not in box, box
            reply = refit.swap()
            assert reply["mode"] == "shadow" and reply["swapped"]["version"] == 1, reply
            ptrs.append(llm.collective_rpc(_embedding_ptr)[0])
            tag, results = f"alt{n}-", {}
            _add_requests(llm, tag, max_tokens=8)
            _run_to_end(llm, results)
        for i, prompt in enumerate(PROMPTS):
            ids, lps = results[f"{tag}{i}"]
            _assert_tokens_of(model, prompt, ids, lps, 0, len(ids), same=True)
    # each connection builds its own shadow; within one, a swap moves the live storage
    assert all(a != b for a, b in zip(ptrs, ptrs[1:], strict=False)), ptrs


def test_two_swaps_on_one_connection_alternate_between_two_storages(llm, model_dir):
    first, second = _model(model_dir, 61), _model(model_dir, 62)
    sender_model = {"m": first}
    sender = RefitSender(lambda: sender_model["m"], torch.float32)
    refit = VllmInflightRefit(llm, sender, timeout_s=30.0)
    try:
        ptrs = [llm.collective_rpc(_embedding_ptr)[0]]
        for n, model in enumerate((first, second, first), start=1):
            sender_model["m"] = model
            box, _ = _refit_while_stepping(llm, refit, steps_before=0)
            assert "error" not in box, box
            assert refit.swap()["swapped"]["version"] == n
            ptrs.append(llm.collective_rpc(_embedding_ptr)[0])
            tag, results = f"two{n}-", {}
            _add_requests(llm, tag, max_tokens=8)
            _run_to_end(llm, results)
            for i, prompt in enumerate(PROMPTS):
                ids, lps = results[f"{tag}{i}"]
                assert refit.token_versions(f"{tag}{i}", len(ids), added=n, finished=n) == [
                    n
                ] * len(ids)
                _assert_tokens_of(model, prompt, ids, lps, 0, len(ids), same=True)
    finally:
        refit.close()
        sender.close()
    assert ptrs[0] != ptrs[1] and ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1], ptrs


def test_a_load_failing_into_the_shadow_keeps_the_live_version_and_the_next_refit_works(
    llm, model_dir
):
    old, new = _model(model_dir, 71), _model(model_dir, 72)
    with _inflight(llm, old) as refit:
        _refit_while_stepping(llm, refit, steps_before=0)
        refit.swap()

    def break_shadow_load(worker):
        shadow = _worker_weights(worker)._shadow
        good = shadow._load

        def load_half_then_fail(pairs):
            pairs = list(pairs)

            def half():
                yield from pairs[: len(pairs) // 2]  # vLLM processes these layers first
                raise KeyError("a name this vLLM model does not map")

            shadow._load = good  # the next refit loads normally
            good(half())

        shadow._load = load_half_then_fail

    with _inflight(llm, new) as refit:
        llm.collective_rpc(break_shadow_load)
        tag, results = "shadowfail-", {}
        _add_requests(llm, tag, max_tokens=30)
        box, _ = _refit_while_stepping(llm, refit)
        assert "a name this vLLM model does not map" in str(box.get("error")), box
        reply = refit.swap()
        assert reply["failures"] == 1 and reply["swapped"] is None and reply["version"] == 0
        for _ in range(2):
            llm.llm_engine.step()  # still the old version, whatever the shadow holds
        box, _ = _refit_while_stepping(llm, refit, steps_before=1)
        assert "error" not in box, box
        reply = refit.swap(recompute_kv=True)
        assert reply["mode"] == "shadow" and reply["swapped"]["version"] == 1, reply
        _run_to_end(llm, results)
    _assert_old_then_new(refit, tag, results, old, new, min_cut=3 + 2 + 1)


def test_without_a_shadow_the_swap_loads_behind_a_snapshot(llm, model_dir, monkeypatch):
    from policyworker.shell.engines import vllm_worker

    old, new = _model(model_dir, 81), _model(model_dir, 82)
    monkeypatch.setattr(vllm_worker, "shadow_unavailable", lambda *a, **k: "forced by a test")
    with _inflight(llm, old) as refit:
        _refit_while_stepping(llm, refit, steps_before=0)
        assert refit.swap()["mode"] == "load"
    with _inflight(llm, new) as refit:
        tag, results = "snapshot-", {}
        _add_requests(llm, tag, max_tokens=20)
        box, _ = _refit_while_stepping(llm, refit)
        assert "error" not in box, box
        reply = refit.swap(recompute_kv=True)
        assert reply["mode"] == "load" and reply["swapped"]["version"] == 1, reply
        _run_to_end(llm, results)
    _assert_old_then_new(refit, tag, results, old, new)


def test_a_refit_by_another_path_is_refused_while_an_inflight_connection_owns_the_weights(
    llm, model_dir
):
    from policyworker.errors import RefitError
    from policyworker.shell.engines.vllm import VllmRefit

    old, other = _model(model_dir, 91), _model(model_dir, 92)
    other_sender = RefitSender(lambda: other, torch.float32)
    try:
        with _inflight(llm, old) as refit:
            _refit_while_stepping(llm, refit, steps_before=0)
            refit.swap()
            direct = VllmRefit(llm, other_sender, timeout_s=30.0)
            with pytest.raises(RefitError, match="serves in-flight refits"):
                direct.refit()
            tag, results = "owned-", {}
            _add_requests(llm, tag, max_tokens=8, prompt=refit.prompt)
            _run_to_end(llm, results)  # the in-flight version still serves, untouched
            for i, prompt in enumerate(PROMPTS):
                ids, lps = results[f"{tag}{i}"]
                _assert_tokens_of(old, prompt, ids, lps, 0, len(ids), same=True)
        direct.refit()  # the in-flight connection closed: the direct refit is taken
        llm.reset_prefix_cache()  # what a direct refit's caller does before new requests
        tag, results = "direct-", {}
        _add_requests(llm, tag, max_tokens=8)
        _run_to_end(llm, results)
        for i, prompt in enumerate(PROMPTS):
            ids, lps = results[f"{tag}{i}"]
            _assert_tokens_of(other, prompt, ids, lps, 0, len(ids), same=True)
    finally:
        other_sender.close()


def test_a_versioned_prompt_added_after_a_kept_swap_reuses_no_block_of_the_previous_version(
    llm, model_dir
):
    old, new = _model(model_dir, 101), _model(model_dir, 102)
    long = [[(7 * i + k) % 120 + 3 for i in range(40)] for k in range(2)]  # a cached block each
    with _inflight(llm, old) as refit:
        _refit_while_stepping(llm, refit, steps_before=0)
        refit.swap(recompute_kv=True)  # clears the cache of earlier tests' weights
    with _inflight(llm, new) as refit:
        versioned = refit.prompt
        _add_requests(llm, "cached-v0-", max_tokens=4, prompt=versioned, prompts=long)
        _add_requests(llm, "cached-plain-", max_tokens=4, prompts=long)
        _run_to_end(llm, {})  # the prompts' first blocks are cached under version 0
        box, _ = _refit_while_stepping(llm, refit, steps_before=0)
        assert "error" not in box and refit.swap()["swapped"]["version"] == 1
        results = {}
        _add_requests(llm, "versioned-", max_tokens=6, prompt=versioned, prompts=long)
        _add_requests(llm, "plain-", max_tokens=6, prompts=long)
        _run_to_end(llm, results)
    for i, prompt in enumerate(long):
        ids, lps = results[f"versioned-{i}"]
        assert refit.token_versions(f"versioned-{i}", len(ids), added=1, finished=1) == [1] * 6
        _assert_tokens_of(new, prompt, ids, lps, 0, len(ids), same=True)
        # the same prompt without the salt: the new weights over a block version 0 cached
        ids, lps = results[f"plain-{i}"]
        _assert_tokens_of(new, prompt, ids, lps, 0, len(ids), same=False)


def _serve_with_a_load_at_the_swap(llm, model, monkeypatch):
    """One version loaded by the snapshot path: vLLM's reload of the live model leaves its
    loaders wrapped in closures over the live layers' reload state."""
    from policyworker.shell.engines import vllm_worker

    with monkeypatch.context() as patch:
        patch.setattr(vllm_worker, "shadow_unavailable", lambda *a, **k: "forced by a test")
        with _inflight(llm, model) as refit:
            _refit_while_stepping(llm, refit, steps_before=0)
            assert refit.swap(recompute_kv=True)["mode"] == "load"


def _generate(llm, tag, refit):
    results = {}
    _add_requests(llm, tag, max_tokens=6, prompt=refit.prompt)
    _run_to_end(llm, results)
    return [results[f"{tag}{i}"] for i in range(len(PROMPTS))]


def test_a_shadow_built_after_a_live_reload_loads_into_itself(llm, model_dir, monkeypatch):
    old, new = _model(model_dir, 111), _model(model_dir, 112)
    _serve_with_a_load_at_the_swap(llm, old, monkeypatch)
    with _inflight(llm, new) as refit:
        box, _ = _refit_while_stepping(llm, refit, steps_before=0)
        assert "error" not in box, box
        assert refit.swap(recompute_kv=True)["mode"] == "shadow"
        outputs = _generate(llm, "after-reload-", refit)
    for prompt, (ids, lps) in zip(PROMPTS, outputs, strict=True):
        _assert_tokens_of(new, prompt, ids, lps, 0, len(ids), same=True)


def test_a_load_whose_layers_got_nothing_fails_instead_of_serving_their_old_tensors(
    llm, model_dir, monkeypatch
):
    from policyworker.shell.engines import vllm_shadow

    old, new = _model(model_dir, 121), _model(model_dir, 122)
    _serve_with_a_load_at_the_swap(llm, old, monkeypatch)
    # the clone keeps the live layers' loader wrappers: its loads go to them and are dropped
    monkeypatch.setattr(vllm_shadow, "RELOAD_WRAPPER", "a name no loader has")
    with _inflight(llm, new) as refit:
        box, _ = _refit_while_stepping(llm, refit, steps_before=0)
        assert "no element of their parameters" in str(box.get("error")), box
        for _ in range(200):  # the worker's thread counts the failure after it replied
            reply = refit.swap()
            if reply["failures"]:
                break
            time.sleep(0.01)
        assert reply["failures"] == 1 and reply["swapped"] is None, reply
        outputs = _generate(llm, "given-nothing-", refit)
    for prompt, (ids, lps) in zip(PROMPTS, outputs, strict=True):
        _assert_tokens_of(old, prompt, ids, lps, 0, len(ids), same=True)
