"""A newcomer's first hour: what the worker says at start-up, the verbosity switch, quiet
progress bars, and errors that name the argument, the value, the rule and the fix."""

import logging
import threading
import time

import pytest
import torch
from torch import nn

from policyworker.errors import DataError, RefitError
from policyworker.functional.loss import ClippedPGLossFn, DPOLossFn, NLLLoss
from policyworker.shell import logs
from policyworker.shell.refit.receiver import HFWeightReceiver
from policyworker.shell.refit.sender import RefitSender
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import make_batch, make_config


@pytest.fixture(scope="module")
def worker(tiny_model_paths):
    w = PolicyWorker(make_config(tiny_model_paths["llama"]))
    yield w
    w.shutdown()


@pytest.fixture
def restore_logger():
    logger = logging.getLogger(logs.LOGGER_NAME)
    level = logger.level
    yield logger
    logger.setLevel(level)


def test_startup_line_and_repr_say_what_was_built(tiny_model_paths, caplog, capfd):
    with caplog.at_level(logging.INFO, logger="policyworker"):
        w = PolicyWorker(make_config(tiny_model_paths["llama"]))
    lines = [r.getMessage() for r in caplog.records if "ready:" in r.getMessage()]
    assert len(lines) == 1
    line = lines[0]
    params = sum(p.numel() for p in w.model.parameters())
    assert line.startswith(f"PolicyWorker ready: model={tiny_model_paths['llama']} (llama, ")
    assert f"{params / 1e3:.2f}K params" in line
    for part in (
        "precision=float32",
        "device=cpu",
        "dp×cp×tp=1×1×1",
        "attention=sdpa",
        "batching=fixed (train mbs 2 of gbs 4, logprob mbs 2)",
        "optimizer=torch.optim.AdamW",
        "reference=kept",
    ):
        assert part in line
    text = repr(w)
    assert text.startswith("PolicyWorker(model=") and "dp×cp×tp=1×1×1" in text
    assert "rank=0/1" in text and "attention='sdpa'" in text
    w.shutdown()
    assert "Loading weights" not in capfd.readouterr().err


def test_progress_bars_are_off_inside_and_restored_after():
    from transformers.utils import logging as hf_logging

    for initially in (True, False):
        (hf_logging.enable_progress_bar if initially else hf_logging.disable_progress_bar)()
        with logs.quiet_progress_bars():
            assert not hf_logging.is_progress_bar_enabled()
        assert hf_logging.is_progress_bar_enabled() == initially
    hf_logging.enable_progress_bar()


def test_verbosity_switch_and_environment_variable(monkeypatch, restore_logger):
    logs.set_verbosity("warning")
    assert restore_logger.level == logging.WARNING
    monkeypatch.setenv(logs.ENV_LOG_LEVEL, "DEBUG")
    logs.apply_env_verbosity()
    assert restore_logger.level == logging.DEBUG
    handlers = [h for h in restore_logger.handlers if isinstance(h, logging.StreamHandler)]
    logs.set_verbosity("info")
    assert len([h for h in restore_logger.handlers if isinstance(h, logging.StreamHandler)]) == (
        len(handlers)
    )  # one handler however often it is called
    with pytest.raises(
        ValueError,
        match=r"set_verbosity level='loud' is not a log level; use "
        r"one of debug, info, warning, error, critical",
    ):
        logs.set_verbosity("loud")
    monkeypatch.setenv(logs.ENV_LOG_LEVEL, "chatty")
    with pytest.raises(ValueError, match=r"POLICYWORKER_LOG_LEVEL='chatty' is not a log level"):
        logs.apply_env_verbosity()


# ---------------------------------------------------------------------------- train() inputs


def test_every_missing_key_is_named_in_one_message(worker):
    data = {k: v for k, v in make_batch().items() if k in ("input_ids", "input_lengths")}
    loss = ClippedPGLossFn({"reference_policy_kl_penalty": 0.01})
    with pytest.raises(DataError) as info:
        worker.train(data, loss)
    message = str(info.value)
    assert (
        "batch is missing 6 required key(s) ['sample_mask', 'token_mask', 'advantages', "
        "'generation_logprobs', 'prev_logprobs', 'reference_policy_logprobs'] "
        "(train() with ClippedPGLossFn reads them)"
    ) in message
    assert "add every missing key" in message
    with pytest.raises(
        DataError,
        match=r"missing 3 required key\(s\) \['sample_mask', "
        r"'token_mask', 'reference_policy_logprobs'\]",
    ):
        worker.train(data, DPOLossFn())
    without_kl = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0})
    assert "reference_policy_logprobs" not in without_kl.required_keys
    assert NLLLoss().required_keys == ("token_mask", "sample_mask")


def test_no_loss_or_the_loss_class_is_a_value_error_saying_the_fix(worker):
    data = make_batch()
    with pytest.raises(
        ValueError,
        match=r"loss_fn is None; pass a loss instance, e\.g\. "
        r"ClippedPGLossFn\(",
    ):
        worker.train(data, None)
    with pytest.raises(
        ValueError,
        match=r"loss_fn is the class ClippedPGLossFn, not an "
        r"instance; pass ClippedPGLossFn\(\.\.\.\)",
    ):
        worker.train(data, ClippedPGLossFn)
    with pytest.raises(ValueError, match=r"loss_fn 'function' has no loss_type or input_type"):
        worker.train(data, lambda *a: None)


def test_a_per_token_sample_mask_is_rejected_before_any_step(worker):
    data = make_batch()
    data["sample_mask"] = torch.ones(4, 12)
    before = [p.detach().clone() for p in worker.model.parameters()]
    with pytest.raises(
        DataError,
        match=r"'sample_mask' has shape \(4, 12\), but it must be "
        r"\[B\].*belongs in 'token_mask'",
    ):
        worker.train(data, NLLLoss())
    with pytest.raises(DataError, match=r"'sample_mask' has shape \(4, 12\)"):
        worker.get_logprobs(data)
    assert all(torch.equal(a, b) for a, b in zip(before, worker.model.parameters(), strict=True))


# ---------------------------------------------------------------------------- refit edges


def test_receiver_address_must_be_ipc_and_exist():
    model = nn.Linear(2, 2)
    info = {"weight": (torch.Size([2, 2]), torch.float32)}
    with pytest.raises(
        ValueError,
        match=r"address='tcp://127\.0\.0\.1:5555': a refit receiver "
        r"connects to the ipc:// address",
    ):
        HFWeightReceiver(model, address="tcp://127.0.0.1:5555", refit_info=info)
    with pytest.raises(
        ValueError,
        match=r"no socket exists at /nonexistent/rank0\.sock, so no "
        r"trainer is listening there",
    ):
        HFWeightReceiver(model, address="ipc:///nonexistent/rank0.sock", refit_info=info)
    sender = RefitSender(lambda: model, torch.float32)
    address = sender.get_zmq_address()
    receiver = HFWeightReceiver(model, address=address, refit_info=info, timeout_s=5)
    sender.close()  # the trainer went away: receive() says so instead of waiting 5 s
    with pytest.raises(ValueError, match="no socket exists"):
        receiver.receive()
    receiver.close()


def test_a_refused_manifest_reaches_the_sender_at_once(caplog):
    model = nn.Linear(4, 3)
    sender = RefitSender(lambda: model, torch.float32)
    address = sender.get_zmq_address()
    wrong = nn.Linear(4, 5)  # the inference side built a different model
    with pytest.raises(ValueError, match="cannot receive"):
        HFWeightReceiver(
            wrong, address=address, refit_info=sender.prepare_refit_info(), timeout_s=30
        )
    start = time.monotonic()
    with (
        caplog.at_level(logging.INFO, logger="policyworker"),
        pytest.raises(
            RefitError,
            match=r"the receiver rejected begin: the receiver refused refit_info "
            r"when it was built: target module cannot receive",
        ),
    ):
        sender.stream_weights_via_ipc_zmq(timeout_s=30)
    assert time.monotonic() - start < 15
    sender.close()


def test_the_sender_says_where_it_waits(caplog):
    model = nn.Linear(4, 3)
    sender = RefitSender(lambda: model, torch.float32)
    address = sender.get_zmq_address()
    got = {}

    def receive():
        time.sleep(0.5)
        receiver = HFWeightReceiver(
            nn.Linear(4, 3), address=address, refit_info=sender.prepare_refit_info(), timeout_s=30
        )
        got["report"] = receiver.receive()
        receiver.close()

    thread = threading.Thread(target=receive)
    thread.start()
    with caplog.at_level(logging.INFO, logger="policyworker"):
        sender.stream_weights_via_ipc_zmq(timeout_s=30)
    thread.join(30)
    assert got["report"].num_tensors == 2
    assert any(
        f"waiting up to 30 s for a receiver at {address}" in r.getMessage() for r in caplog.records
    )
    sender.close()


# ---------------------------------------------------------------------------- demo --plot


def test_plot_without_matplotlib_or_folder_fails_before_the_run(monkeypatch, tmp_path, capsys):
    from policyworker import cli

    started = []
    monkeypatch.setattr("policyworker.demo.loop.run_demo", lambda opts: started.append(opts))
    real = cli._can_import
    monkeypatch.setattr(cli, "_can_import", lambda m: m != "matplotlib" and real(m))
    assert cli.main(["demo", "--plot", str(tmp_path / "curve.png")]) == 2
    assert (
        "--plot " + str(tmp_path / "curve.png") + ": the chart needs matplotlib, which is "
        "not installed; pip install 'policyworker[plot]'"
    ) in capsys.readouterr().err
    monkeypatch.setattr(cli, "_can_import", lambda m: True)
    assert cli.main(["demo", "--plot", str(tmp_path / "no" / "curve.png")]) == 2
    assert f"the folder {tmp_path / 'no'} does not exist" in capsys.readouterr().err
    assert started == []  # the demo never ran


def test_plot_has_a_legend_for_both_curves_and_whole_step_ticks(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="the `plot` extra (installed by the test extra)")
    import matplotlib.pyplot as plt

    from policyworker.demo import report

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to inspect it
    assert report.save_plot(str(tmp_path / "c.png"), [0.1, 0.5, 0.9], [0.0, 0.2, 0.4])
    assert (tmp_path / "c.png").stat().st_size > 0
    ax = figures[0].axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "reward (mean per step)",
        "kl to reference",
    ]
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)
