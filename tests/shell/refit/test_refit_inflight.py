"""Refits in flight on the HF inference side: a new version streams into staging while the
module keeps sampling, and is swapped in between two decode steps.

The sender runs on its own thread while the decode loop (this test's thread) samples; hooks
between decode steps only order the test, never carry the weights. Every sampled token's version
is checked by recomputing its logprob under each version's weights.
"""

import copy
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from policyworker.demo.inference import InferenceProcess, generate_tagged
from policyworker.functional.dtypes import encode_refit_info
from policyworker.shell.refit.inflight import InflightWeights
from policyworker.shell.refit.sender import RefitSender

PROMPTS = torch.tensor([[2, 5, 9, 11], [2, 7, 3, 4], [2, 60, 61, 62]])


def _load(path):
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    model.config.use_cache = False
    return model.eval()


@pytest.fixture(params=[None, True], ids=["staged", "one_pass"])
def setup(tiny_model_paths, request):
    """``one_pass`` None serves a CPU module staged; True registers its spare arena."""
    trainer, serving = _load(tiny_model_paths["llama"]), _load(tiny_model_paths["llama"])
    sender = RefitSender(lambda: trainer, torch.float32)
    weights = InflightWeights(
        serving,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        timeout_s=30,
        one_pass=request.param,
    )
    assert weights.mode == ("one_pass" if request.param else "load")
    weights.start()
    versions = {0: copy.deepcopy(trainer)}
    yield trainer, serving, sender, weights, versions
    weights.close()
    sender.close()


def _next_version(trainer, versions, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    versions[len(versions)] = copy.deepcopy(trainer)


def _send_in_thread(sender, box):
    def run():
        try:
            box["report"] = sender.stream_weights_via_ipc_zmq(
                buffer_size_bytes=1 << 16, timeout_s=30
            )
        except Exception as exc:  # surfaced by the test
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@torch.no_grad()
def _logprobs_under(model, ids):
    logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
    return logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


def _check_token_versions(sampled, versions):
    """Every sampled token's logprob is its own version's, and not another version's."""
    ids = torch.cat([PROMPTS, sampled.tokens], dim=1)
    lp = PROMPTS.shape[1]
    gen = sampled.generation_logprobs[:, lp:]
    tags = sampled.versions[:, lp:]
    under = {v: _logprobs_under(m, ids)[:, lp - 1 :] for v, m in versions.items()}
    for v, recomputed in under.items():
        mine = tags == v
        torch.testing.assert_close(gen[mine], recomputed[mine], rtol=0, atol=1e-5)
        for other, theirs in under.items():
            if other != v and mine.any():
                assert ((gen[mine] - theirs[mine]).abs() > 1e-4).float().mean() > 0.9


def test_refit_during_generation_swaps_between_decode_steps(setup):
    trainer, serving, sender, weights, versions = setup
    _next_version(trainer, versions, seed=1)
    box, started = {}, {}
    embed_ptr = serving.model.embed_tokens.weight.data_ptr()

    def between(t):
        if t == 3:  # the transfer starts while decode steps 3.. keep sampling
            started["thread"] = _send_in_thread(sender, box)
        if t == 9:  # by here the stream is done and staged (served from the next step)
            started["thread"].join(30)
            assert "error" not in box, box
            assert weights.received == 1

    sampled = generate_tagged(serving, PROMPTS, 16, seed=0, weights=weights, between_steps=between)
    lp = PROMPTS.shape[1]
    assert box["report"]["version"] == 1
    switch = _switch_step(sampled.versions[:, lp:])
    assert 3 <= switch <= 9  # sampling went on while the transfer ran
    assert [s.version for s in sampled.swaps] == [1]
    assert sampled.swaps[0].seconds < 5
    moved = serving.model.embed_tokens.weight.data_ptr() != embed_ptr
    assert moved == (weights.mode == "load")  # staged: re-pointed; one-pass: copied in place
    _check_token_versions(sampled, versions)
    assert all(
        torch.equal(a, b)
        for a, b in zip(serving.state_dict().values(), trainer.state_dict().values(), strict=True)
    )


def _switch_step(tags):
    """The decode step every row switched from version 0 to 1 at (one swap, all rows at once)."""
    switch = int((tags[0] == 0).sum())
    expected = torch.zeros_like(tags)
    expected[:, switch:] = 1
    assert torch.equal(tags, expected), tags
    return switch


def _fail_after(sender, count, weights):
    """The sender's next refits die after ``count`` tensors; undo with the returned callable."""
    if weights.mode == "one_pass":
        writer = sender._one_pass_writer
        write = writer.write

        def write_some_then_fail(specs, views, sources, plain=None, **kwargs):
            with torch.no_grad():
                for view in views[:count]:
                    view.fill_(7.0)  # what a dying trainer left in the spare
            raise OSError("trainer killed mid-refit")

        writer.write = write_some_then_fail
        return lambda: setattr(writer, "write", write)
    original = sender._zmq().stream

    def failing_stream(specs, plan, sources, **kwargs):
        def sources_then_fail():
            for _ in range(count):
                yield next(sources)
            raise OSError("trainer killed mid-refit")

        kwargs["plain"] = None  # read the tensors through the failing sources
        return original(specs, plan, sources_then_fail(), **kwargs)

    sender._zmq().stream = failing_stream
    return lambda: setattr(sender._zmq(), "stream", original)


def test_a_refit_killed_midway_leaves_the_previous_version_serving_and_the_next_works(setup):
    trainer, serving, sender, weights, versions = setup
    _next_version(trainer, versions, seed=2)
    restore = _fail_after(sender, 3, weights)
    box, second, threads = {}, {}, {}

    def between(t):
        if t == 2:
            threads["bad"] = _send_in_thread(sender, box)
        if t == 6:
            threads["bad"].join(30)
            assert isinstance(box.get("error"), OSError)
            assert weights.wait(failures=1, timeout_s=10)  # the receiver saw the abort
            assert weights.failures == 1 and not weights.pending and weights.version == 0
            restore()
            threads["good"] = _send_in_thread(sender, second)
        if t == 12:
            threads["good"].join(30)
            assert "error" not in second, second
            assert weights.wait(received=1, timeout_s=10) and weights.failures == 1

    sampled = generate_tagged(serving, PROMPTS, 18, seed=1, weights=weights, between_steps=between)
    lp = PROMPTS.shape[1]
    assert 6 <= _switch_step(sampled.versions[:, lp:]) <= 12  # version 0 until the good one
    _check_token_versions(sampled, versions)


def test_two_refits_before_a_swap_serve_only_the_newest(setup):
    trainer, serving, sender, weights, versions = setup
    for seed in (3, 4):
        _next_version(trainer, versions, seed=seed)
        box = {}
        _send_in_thread(sender, box).join(30)
        assert "error" not in box, box
    sampled = generate_tagged(serving, PROMPTS, 4, seed=2, weights=weights)
    assert [s.version for s in sampled.swaps] == [2]
    assert bool((sampled.versions == 2).all())
    del versions[1]  # never served
    _check_token_versions(sampled, versions)


def test_the_inference_process_tags_tokens_and_reports_swaps(tiny_model_paths):
    trainer = _load(tiny_model_paths["llama"])
    sender = RefitSender(lambda: trainer, torch.float32)
    proc = InferenceProcess(tiny_model_paths["llama"], timeout_s=60)
    try:
        proc.call(
            "connect",
            address=sender.get_zmq_address(),
            refit_info=encode_refit_info(sender.prepare_refit_info()),
            timeout_s=30,
            inflight=True,
        )
        with pytest.raises(Exception, match="in flight"):
            proc.call("refit")
        _next_version(trainer, {}, seed=5)
        proc.request(
            "generate", prompts=PROMPTS.tolist(), response_len=40, seed=0, score_micro_batch_size=2
        )
        sender.stream_weights_via_ipc_zmq(timeout_s=30)  # while the process samples
        first = proc.result("generate")
        second = proc.call(
            "generate", prompts=PROMPTS.tolist(), response_len=3, seed=0, score_micro_batch_size=2
        )
    finally:
        proc.close()
        sender.close()
    tags = torch.tensor(first["generation_versions"])
    assert bool((tags[:, 1:] >= tags[:, :-1]).all())  # one swap, never back
    assert [v for v, _ in first["swaps"]] == [1] and first["served_version"] == 1
    assert bool((torch.tensor(second["generation_versions"]) == 1).all())
    assert second["swaps"] == []


def test_a_version_in_another_dtype_is_swapped_by_a_casting_copy(tiny_model_paths):
    trainer, serving = _load(tiny_model_paths["llama"]), _load(tiny_model_paths["llama"])
    _next_version(trainer, {}, seed=6)
    sender = RefitSender(lambda: trainer, torch.bfloat16)  # bf16 refit into an fp32 module
    weights = InflightWeights(
        serving,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        timeout_s=30,
    )
    weights.start()
    try:
        ptr = serving.model.embed_tokens.weight.data_ptr()
        box = {}
        _send_in_thread(sender, box).join(30)
        assert "error" not in box, box
        assert weights.swap().version == 1
        assert serving.model.embed_tokens.weight.data_ptr() == ptr  # copied in place
        for (name, got), want in zip(
            serving.state_dict().items(), trainer.state_dict().values(), strict=True
        ):
            assert got.dtype == torch.float32
            assert torch.equal(got, want.to(torch.bfloat16).float()), name
    finally:
        weights.close()
        sender.close()


def test_a_refit_dying_after_a_complete_one_keeps_serving_only_whole_versions(setup):
    """Version 1 arrives complete and waits for a swap; refit 2 dies midway. Staged, version 1
    has its own copies and still serves; one-pass, refit 2 was writing the spare version 1 was
    held in, so version 1 is dropped and the swap serves nothing until a complete refit."""
    trainer, serving, sender, weights, versions = setup
    _next_version(trainer, versions, seed=7)
    box = {}
    _send_in_thread(sender, box).join(30)
    assert "error" not in box and weights.wait(received=1, timeout_s=10)
    _next_version(trainer, versions, seed=8)
    restore = _fail_after(sender, 3, weights)
    _send_in_thread(sender, box).join(30)
    assert isinstance(box.get("error"), OSError)
    assert weights.wait(failures=1, timeout_s=10)
    swap = weights.swap()
    if weights.mode == "one_pass":
        assert swap is None and weights.version == 0
        sampled = generate_tagged(serving, PROMPTS, 3, seed=3, weights=weights)
        assert bool((sampled.versions == 0).all())
    else:
        assert swap.version == 1
    restore()
    box = {}
    _send_in_thread(sender, box).join(30)
    assert "error" not in box, box
    sampled = generate_tagged(serving, PROMPTS, 4, seed=4, weights=weights)
    assert bool((sampled.versions == 2).all())
    _check_token_versions(sampled, versions)
