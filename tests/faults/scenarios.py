"""Fault scenarios of the refit transports, each runnable in a fresh process.

``python -m tests.faults.scenarios NAME TRIALS [ARG]`` runs TRIALS trials of scenario NAME and
prints one ``@@{"trial": i, "ok": bool, "detail": str}`` line per trial. A scenario whose fault
kills the process (SIGBUS, a libzmq abort) prints fewer lines: ``run_scenario`` reports the
signal. The fault tier (``tests/faults``) runs these against the working tree; the closing notes'
before/after tables came from running the same commands against the code before the fixes.

Only public names that exist before and after the fixes are used, so the same scenario measures
both, except ``SHM_DIR``: it is set directly (the old code has no ``POLICYWORKER_SHM_DIR``), in
``policyworker.shell.refit.zmq.ipc_files`` since the ZMQ transport was split (``zmq_ipc.SHM_DIR``
before).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch
from torch import nn

torch.set_num_threads(1)


RESULTS: list[dict[str, Any]] | None = None  # set to a list to collect results in-process


def say(trial: int, ok: bool, detail: str = "") -> None:
    result = {"trial": trial, "ok": bool(ok), "detail": detail[:600]}
    if RESULTS is not None:
        RESULTS.append(result)
    else:
        print("@@" + json.dumps(result), flush=True)


class Weights(nn.Module):
    """fp32 tensors: ``n`` rows of 256 floats (1 KiB each) in ``parts`` parameters."""

    def __init__(self, n: int = 16, seed: int = 0, parts: int = 4) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        rows = max(n // parts, 1)
        for i in range(parts):
            setattr(self, f"w{i}", nn.Parameter(torch.randn(rows, 256, generator=gen)))


def serve_forever(receiver: Any, stop: threading.Event, errors: list[str]) -> threading.Thread:
    """A receiver loop like an engine's refit thread: receive() again after each timeout."""
    from policyworker.errors import RefitError, RefitTimeoutError

    def run() -> None:
        while not stop.is_set():
            try:
                receiver.receive()
            except RefitTimeoutError:
                continue
            except RefitError as exc:
                if not stop.is_set():
                    errors.append(f"{type(exc).__name__}: {exc}")
            except Exception as exc:  # reported by the scenario
                errors.append(f"{type(exc).__name__}: {exc}")
                return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# ----------------------------------------------------------------------------- 21.1 grad mode


def grad_mode_zmq(trials: int) -> None:
    """A receiver whose refit_info lacks one streamed name rejects the refit midway."""
    from policyworker.errors import RefitError
    from policyworker.shell.refit.receiver import HFWeightReceiver
    from policyworker.shell.refit.sender import RefitSender

    model = Weights()
    sender = RefitSender(lambda: model, torch.float32)
    info = sender.prepare_refit_info()
    info.pop("w3")
    for trial in range(trials):
        torch.set_grad_enabled(True)
        receiver = HFWeightReceiver(
            lambda pairs: None, address=sender.get_zmq_address(), refit_info=info, timeout_s=10
        )
        box: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: box.update(error=_catch(receiver.receive)))  # noqa: B023
        thread.start()
        grad_at_raise = None
        try:
            sender.stream_weights_via_ipc_zmq(timeout_s=10)
            error = "no error"
        except RefitError as exc:  # checked while the caller holds the error, as a handler does
            grad_at_raise, error = torch.is_grad_enabled(), f"{type(exc).__name__}: {exc}"
        thread.join(10)
        receiver.close()
        _wait_until_the_sender_counts(sender, 0)
        trainable = (model.w0 * 2).sum().requires_grad
        say(
            trial,
            grad_at_raise and torch.is_grad_enabled() and trainable and "rejected" in error,
            f"grad enabled when raised {grad_at_raise}, after {torch.is_grad_enabled()}; "
            f"{error[:200]}",
        )
    sender.close()


def _wait_until_the_sender_counts(sender: Any, receivers: int) -> None:
    """The scenarios close receivers and connect new ones to the same address at once: wait
    until the sender has seen them come and go (`RefitSender.wait_for_receivers`), or a BEGIN
    can be lost on a closing connection and a count taken too early misses the new ones."""
    sender.wait_for_receivers(receivers, timeout_s=10.0)


def grad_mode_sglang(trials: int) -> None:
    """The engine answers its second call with success=False."""
    from policyworker.errors import RefitError
    from policyworker.shell.refit.sglang import SGLangColocatedSender
    from policyworker.shell.refit.weight_stream import params_generator

    model = Weights()

    class Engine:
        calls = 0

        def update_weights_from_tensor(self, **kwargs: Any) -> dict[str, Any]:
            Engine.calls += 1
            return {"success": Engine.calls % 2 == 1, "message": "engine out of memory"}

    sender = SGLangColocatedSender(rank=0, world_size=1)
    sender.set_rollout_num_gpus_per_engine(1)
    for trial in range(trials):
        torch.set_grad_enabled(True)
        Engine.calls = 0
        grad_at_raise = None
        try:
            sender.update_weights(
                params_generator(model, torch.float32),
                rollout_engines=[Engine()],
                buffer_size_bytes=4096,
            )
            error = "no error"
        except RefitError as exc:
            grad_at_raise, error = torch.is_grad_enabled(), str(exc)
        say(
            trial,
            grad_at_raise and torch.is_grad_enabled() and "out of memory" in error,
            f"grad enabled when raised {grad_at_raise}, after {torch.is_grad_enabled()}; "
            f"{error[:200]}",
        )


COLLECTIVE_CHILD = r"""
import json, os, signal, sys
import torch
torch.set_num_threads(1)
from policyworker.shell.refit import collective as C
from policyworker.functional.wire.codec import DTYPES_BY_NAME
port, info_path = int(sys.argv[1]), sys.argv[2]
info = {n: (s, DTYPES_BY_NAME[d]) for n, (s, d) in json.load(open(info_path)).items()}
group = C.init_collective("127.0.0.1", port, 2, train_world_size=1, rank=1, timeout_s=30.0)
seen = [0]
def apply(pairs):
    seen[0] += 1
    if seen[0] == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # a real SIGKILL mid-broadcast
receiver = C.CollectiveWeightReceiver(apply, group=group, refit_info=info)
receiver.receive(refit_timeout_s=30.0)
"""


def grad_mode_collective(trials: int) -> None:
    """The only inference rank is SIGKILLed after its first bucket; the watchdog fires."""
    import socket

    from policyworker.errors import RefitTimeoutError
    from policyworker.shell.refit import collective as C
    from policyworker.shell.refit.weight_stream import refit_info
    from tests.helpers import child_env, write_refit_info

    model = Weights(32)
    folder = tempfile.mkdtemp()
    write_refit_info(refit_info(model, torch.float32), os.path.join(folder, "info.json"))
    for trial in range(trials):
        torch.set_grad_enabled(True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        child = subprocess.Popen(
            [sys.executable, "-c", COLLECTIVE_CHILD, str(port), os.path.join(folder, "info.json")],
            env=child_env(),
        )
        group = C.init_collective("127.0.0.1", port, 2, train_world_size=1, rank=0, timeout_s=30.0)
        grad_at_raise = None
        try:
            C.broadcast_model_weights(
                group,
                model,
                torch.float32,
                refit_timeout_s=3.0,
                buffer_size_bytes=4096,
                num_buffers=1,
            )
            error = "no error"
        except RefitTimeoutError as exc:
            grad_at_raise, error = torch.is_grad_enabled(), f"{type(exc).__name__}: {exc}"
        code = child.wait(30)
        say(
            trial,
            grad_at_raise and torch.is_grad_enabled() and code == -signal.SIGKILL,
            f"grad enabled when raised {grad_at_raise}, after {torch.is_grad_enabled()}; "
            f"child exit {code}; {error[:200]}",
        )


def _catch(fn: Any) -> Any:
    try:
        fn()
        return None
    except Exception as exc:
        return exc


# ----------------------------------------------------------------------------- 21.2 / 21.3


def close_while_receiving(trials: int) -> None:
    """close() from the main thread while another thread waits in receive()."""
    from policyworker.errors import RefitError
    from policyworker.shell.refit.receiver import HFWeightReceiver
    from policyworker.shell.refit.sender import RefitSender

    model = Weights()
    sender = RefitSender(lambda: model, torch.float32)
    info = sender.prepare_refit_info()
    for trial in range(trials):
        receiver = HFWeightReceiver(
            lambda pairs: None, address=sender.get_zmq_address(), refit_info=info, timeout_s=5.0
        )
        box: dict[str, Any] = {}

        def wait(receiver: Any = receiver, box: dict[str, Any] = box) -> None:
            box["error"] = _catch(receiver.receive)
            box["at"] = time.monotonic()

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.3)
        start = time.monotonic()
        receiver.close()
        closed_in = time.monotonic() - start
        thread.join(10)
        error = box.get("error")
        waited = box.get("at", float("inf")) - start
        ok = (
            isinstance(error, RefitError)
            and "closed" in str(error)
            and waited < 2.0
            and closed_in < 2.5
        )
        say(
            trial,
            ok,
            f"close() took {closed_in:.2f} s; receive() ended {waited:.2f} s after it "
            f"with {type(error).__name__}: {error}",
        )
    sender.close()


def failed_construction(trials: int) -> None:
    """A receiver on an over-long ipc path, and a sender whose socket folder's path is too long:
    both must raise at construction and leave no open ZMQ socket or context."""
    import gc

    import zmq

    from policyworker.shell.refit import zmq as zmq_ipc
    from policyworker.shell.refit.receiver import HFWeightReceiver

    def open_zmq() -> int:
        gc.collect()
        return sum(
            1 for o in gc.get_objects() if isinstance(o, (zmq.Context, zmq.Socket)) and not o.closed
        )

    info = {"w": (torch.Size([4]), torch.float32)}
    long_tmp = os.path.join(tempfile.gettempdir(), "t" * 110)
    os.makedirs(long_tmp, exist_ok=True)
    for trial in range(trials):
        before = open_zmq()
        problems = []
        try:
            receiver = HFWeightReceiver(
                lambda pairs: None,
                address="ipc:///tmp/" + "x" * 120 + "/s",
                refit_info=info,
                timeout_s=1.0,
            )
            problems.append("receiver construction succeeded")
            receiver.close()
        except Exception as exc:
            held = exc  # a caller keeping the error must not keep a live context with it
            if not isinstance(held, ValueError):
                problems.append(f"receiver raised {type(held).__name__}, not ValueError: {held}")
            if open_zmq() != before:
                problems.append(
                    f"{open_zmq() - before} ZMQ socket/context left open by the receiver"
                )
        old, tempfile.tempdir = tempfile.tempdir, long_tmp
        try:
            sender = zmq_ipc.ZmqIpcSender(rank=0)
            problems.append("sender construction succeeded with a 110-byte socket folder")
            sender.close()
        except Exception as exc:
            held = exc
            if not isinstance(held, ValueError) or "TMPDIR" not in str(held):
                problems.append(f"sender raised {type(held).__name__}: {held}")
            if open_zmq() != before:
                problems.append(f"{open_zmq() - before} ZMQ socket/context left open by the sender")
        finally:
            tempfile.tempdir = old
        leftovers = [n for n in os.listdir(long_tmp) if n.startswith("pw-refit-")]
        if leftovers:
            problems.append(f"socket folders left behind: {leftovers}")
        say(trial, not problems, "; ".join(problems))
    shutil.rmtree(long_tmp, ignore_errors=True)


def dropped_in_a_cycle(trials: int) -> None:
    """A sender and a receiver that served a refit are dropped without close(), held only by a
    reference cycle (as a caught exception's traceback makes one): the garbage collector must
    free their sockets, contexts and the sender's socket folder without blocking."""
    import gc

    import zmq

    from policyworker.shell.refit.receiver import HFWeightReceiver
    from policyworker.shell.refit.sender import RefitSender

    def open_zmq() -> int:
        return sum(
            1 for o in gc.get_objects() if isinstance(o, (zmq.Context, zmq.Socket)) and not o.closed
        )

    gc.collect()
    before = open_zmq()
    for trial in range(trials):
        model = Weights(8)
        sender = RefitSender(lambda model=model: model, torch.float32)
        address = sender.get_zmq_address()
        folder = os.path.dirname(address.removeprefix("ipc://"))
        receiver = HFWeightReceiver(
            lambda pairs: None, address=address, refit_info=sender.prepare_refit_info()
        )
        thread = threading.Thread(target=receiver.receive)
        thread.start()
        sender.stream_weights_via_ipc_zmq(timeout_s=30)
        thread.join(30)
        cycle: dict[str, Any] = {"pair": (sender, receiver)}
        cycle["self"] = cycle
        del sender, receiver, cycle, thread
        start = time.monotonic()
        gc.collect()  # before the fix this blocked for good in a zmq.Context's term()
        took = time.monotonic() - start
        problems = []
        if open_zmq() != before:
            problems.append(f"{open_zmq() - before} ZMQ socket/context still open")
        if os.path.exists(folder):
            problems.append(f"the socket folder {folder} is still there")
        say(trial, not problems and took < 5, f"gc took {took:.2f} s; " + "; ".join(problems))


# ----------------------------------------------------------------------------- 18.9 two threads


def two_threads_one_sender(trials: int) -> None:
    """Two threads call stream_weights_via_ipc_zmq on one sender at once."""
    from policyworker.errors import RefitError
    from policyworker.shell.refit.receiver import HFWeightReceiver
    from policyworker.shell.refit.sender import RefitSender

    model = Weights(64)
    sender = RefitSender(lambda: model, torch.float32)
    receiver = HFWeightReceiver(
        lambda pairs: None,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        timeout_s=0.5,
    )
    stop, serve_errors = threading.Event(), []
    server = serve_forever(receiver, stop, serve_errors)
    for trial in range(trials):
        barrier, results = threading.Barrier(2), []

        def refit(barrier: threading.Barrier = barrier, results: list[str] = results) -> None:
            barrier.wait()
            try:
                sender.stream_weights_via_ipc_zmq(buffer_size_bytes=8192, timeout_s=5)
                results.append("ok")
            except RefitError as exc:
                results.append("refused" if "another thread" in str(exc) else f"error: {exc}")
            except Exception as exc:
                results.append(f"error: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=refit) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        ok = "ok" in results and all(r in ("ok", "refused") for r in results) and len(results) == 2
        say(trial, ok, f"{results}")
        time.sleep(0.6)  # the receiver loop settles (a refused refit sent nothing)
    stop.set()
    server.join(10)  # closing a receiver that a thread waits in is another fault (21.2)
    receiver.close()
    sender.close()


# ----------------------------------------------------------------------------- 18.7 retry race


def retry_after_idle_timeout(trials: int) -> None:
    """The receiver's receive() times out idle (0.2 s) and is called again at once; the sender
    starts streaming at that moment (within +-1.5 ms of the timeout, swept over the trials)."""
    from policyworker.errors import RefitError, RefitTimeoutError
    from policyworker.shell.refit.receiver import HFWeightReceiver
    from policyworker.shell.refit.sender import RefitSender

    model = Weights()
    sender = RefitSender(lambda: model, torch.float32)
    receiver = HFWeightReceiver(
        lambda pairs: None,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        timeout_s=0.2,
    )
    for trial in range(trials):
        started: list[float] = []
        outcome: list[str] = []

        def engine_loop(started: list[float] = started, outcome: list[str] = outcome) -> None:
            started.append(time.monotonic())
            for _ in range(3):  # receive() again right after each idle timeout
                try:
                    receiver.receive()
                    outcome.append("received")
                    return
                except RefitTimeoutError:
                    continue
                except RefitError as exc:
                    outcome.append(str(exc))
                    return

        thread = threading.Thread(target=engine_loop)
        thread.start()
        while not started:
            time.sleep(0.001)
        offset = -0.0015 + 0.003 * (trial % 7) / 6
        time.sleep(max(0.0, started[0] + 0.2 + offset - time.monotonic()))
        try:
            sender.stream_weights_via_ipc_zmq(timeout_s=1.0)
            result = "ok"
        except RefitError as exc:
            result = f"{type(exc).__name__}: {str(exc)[:150]}"
        thread.join(10)
        say(
            trial,
            result == "ok" and outcome == ["received"],
            f"offset {offset * 1000:+.1f} ms; sender: {result}; receiver: {outcome}",
        )
    receiver.close()
    sender.close()


# ----------------------------------------------------------------------------- 18.8 two receivers


def two_receivers_one_address(trials: int) -> None:
    """Two receivers connect to one sender; both serve in loops."""
    from policyworker.errors import RefitError
    from policyworker.shell.refit.receiver import HFWeightReceiver
    from policyworker.shell.refit.sender import RefitSender

    model = Weights()
    sender = RefitSender(lambda: model, torch.float32)
    info = sender.prepare_refit_info()
    for trial in range(trials):
        versions, stop, errors = [], threading.Event(), []
        receivers = [
            HFWeightReceiver(
                lambda pairs: None, address=sender.get_zmq_address(), refit_info=info, timeout_s=0.3
            )
            for _ in range(2)
        ]
        servers = [serve_forever(r, stop, errors) for r in receivers]
        _wait_until_the_sender_counts(sender, 2)
        try:
            sender.stream_weights_via_ipc_zmq(timeout_s=2.0)
            outcome = "success"
        except RefitError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        time.sleep(0.4)
        versions = [r.version for r in receivers]
        stop.set()
        for server in servers:
            server.join(10)
        for r in receivers:
            r.close()
        _wait_until_the_sender_counts(sender, 0)
        detected = "2 receivers are connected" in outcome
        say(trial, detected and versions == [0, 0], f"versions {versions}; sender: {outcome[:300]}")
    sender.close()


# ----------------------------------------------------------------------------- 18.10 frame cap


RECEIVER_CHILD = r"""
import json, resource, sys, time
import torch
torch.set_num_threads(1)
from policyworker.shell.refit.receiver import HFWeightReceiver
address = sys.argv[1]
info = {f"w{i}": (torch.Size([64, 256]), torch.float32) for i in range(4)}
receiver = HFWeightReceiver(lambda pairs: None, address=address, refit_info=info, timeout_s=2.0)
print("@@ready", flush=True)
for line in sys.stdin:
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cpu0 = time.process_time()
    try:
        receiver.receive()
        error = "none"
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc)[:200]}"
    rss_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    print("@@" + json.dumps({"rss_mib": rss_mib, "cpu_s": time.process_time() - cpu0,
                             "error": error}), flush=True)
receiver.close()
"""


def oversized_messages(trials: int) -> None:
    """A same-user peer binds a REQ socket where a receiver process expecting four tensors
    connects, and sends a 16 MiB manifest of well-formed specs, then a 256 MiB header frame."""
    import zmq

    from policyworker.functional.buckets import TensorSpec
    from policyworker.functional.wire.codec import (
        PROTOCOL,
        PROTOCOL_VERSION,
        Abort,
        Begin,
        decode_reply,
        encode,
    )
    from tests.helpers import child_env

    # ~16 MiB of well-formed specs (each about 45 bytes)
    manifest = json.dumps(
        [[f"model.layers.{i}.weight", "float32", [8, 8]] for i in range(360_000)]
    ).encode()
    begin = json.dumps(
        {
            "protocol": PROTOCOL,
            "version": PROTOCOL_VERSION,
            "kind": "begin",
            "rank": 0,
            "transport": "shm",
            "alignment": 256,
            "num_tensors": 1,
        }
    ).encode()
    big_header = b" " * (256 << 20)
    folder = tempfile.mkdtemp()
    address = f"ipc://{folder}/peer.sock"
    context = zmq.Context()
    # A receiver refuses an address with no socket behind it, so one listens while it starts;
    # each trial below then binds a fresh peer at the same path (ZMQ reconnects by path).
    placeholder = context.socket(zmq.REQ)
    placeholder.setsockopt(zmq.LINGER, 0)
    placeholder.bind(address)
    child = subprocess.Popen(
        [sys.executable, "-c", RECEIVER_CHILD, address],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().startswith("@@ready")
    placeholder.close(linger=0)
    for trial in range(trials):
        for name, frames in (
            ("16 MiB manifest", [begin, manifest]),
            ("256 MiB header", [big_header]),
        ):
            peer = context.socket(zmq.REQ)  # a fresh peer each time: the receiver may drop one
            peer.setsockopt(zmq.LINGER, 0)
            peer.bind(address)
            child.stdin.write("go\n")
            child.stdin.flush()
            peer.send_multipart(frames, copy=False)
            line = child.stdout.readline()
            peer.close(linger=0)
            try:
                result = json.loads(line[2:])
            except ValueError:
                say(trial, False, f"{name}: the receiver died (exit {child.wait(30)})")
                return
            ok = result["rss_mib"] < 64 and result["cpu_s"] < 1.0
            say(
                trial,
                ok,
                f"{name}: receiver peak RSS +{result['rss_mib']:.0f} MiB, "
                f"{result['cpu_s']:.2f} s CPU; {result['error'][:120]}",
            )
        # the receiver still serves a well-behaved peer: a BEGIN it accepts, then an ABORT
        peer = context.socket(zmq.REQ)
        peer.setsockopt(zmq.LINGER, 0)
        peer.setsockopt(zmq.RCVTIMEO, 10_000)
        peer.bind(address)
        child.stdin.write("go\n")
        child.stdin.flush()
        specs = tuple(TensorSpec(f"w{i}", (64, 256), torch.float32) for i in range(4))
        replies = []
        try:
            for message in (Begin(0, "shm", 256, specs), Abort("done")):
                peer.send_multipart(encode(message))
                replies.append(decode_reply(peer.recv_multipart()).ok)
        except zmq.Again:
            replies.append("no reply")
        result = json.loads(child.stdout.readline()[2:])
        peer.close(linger=0)
        say(
            trial,
            replies == [True, True] and "aborted" in result["error"],
            f"a well-behaved peer afterwards: replies {replies}; receiver: {result['error'][:100]}",
        )
    child.stdin.close()
    child.wait(30)
    context.term()


# ----------------------------------------------------------------------------- 18.1 small shm


def small_shm(trials: int, folder: str) -> None:
    """CPU refits of 256 KiB of weights (16 tensors of 16 KiB) staged on a 128 KiB tmpfs
    mounted at ``folder``: the default size (one 256 KiB buffer before the fix), then buffers
    too large for it on purpose (2 x 256 KiB), then the default again."""
    from policyworker.errors import RefitError
    from policyworker.shell.refit.receiver import HFWeightReceiver
    from policyworker.shell.refit.sender import RefitSender
    from policyworker.shell.refit.zmq import ipc_files

    ipc_files.SHM_DIR = folder
    model = Weights(256, parts=16)
    sender = RefitSender(lambda: model, torch.float32)
    receiver = HFWeightReceiver(
        lambda pairs: None,
        address=sender.get_zmq_address(),
        refit_info=sender.prepare_refit_info(),
        timeout_s=10,
    )
    for trial in range(trials):
        outcomes = []
        for budget in (0, 512 << 10, 0):
            box: dict[str, Any] = {}
            thread = threading.Thread(
                target=lambda box=box, receiver=receiver: box.update(error=_catch(receiver.receive))
            )
            thread.start()
            try:
                sender.stream_weights_via_ipc_zmq(buffer_size_bytes=budget, timeout_s=10)
                outcomes.append("ok")
            except RefitError as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")
            thread.join(10)
        left = os.listdir(folder)
        clear = "--shm-size" in outcomes[1] and "262144 bytes" in outcomes[1]
        ok = outcomes[0] == outcomes[2] == "ok" and clear and not left
        say(
            trial,
            ok,
            f"{outcomes[0][:100]} | {outcomes[1][:300]} | {outcomes[2][:100]}; left {left}",
        )
    receiver.close()
    sender.close()


def truncated_kept_buffer(trials: int) -> None:
    """A keep_staging refit, then its kept staging file is truncated to 0 bytes (e.g. a cleaner
    or another process), then the next refit. Sender and receiver thread share this process."""
    from policyworker.errors import RefitError
    from policyworker.shell.refit.receiver import HFWeightReceiver
    from policyworker.shell.refit.sender import RefitSender
    from policyworker.shell.refit.zmq import ipc_files

    model = Weights(64)
    for trial in range(trials):
        sender = RefitSender(lambda: model, torch.float32, keep_staging=True)
        receiver = HFWeightReceiver(
            lambda pairs: None,
            address=sender.get_zmq_address(),
            refit_info=sender.prepare_refit_info(),
            timeout_s=10,
        )
        outcomes = []
        for step in range(2):
            box: dict[str, Any] = {}
            thread = threading.Thread(
                target=lambda box=box, receiver=receiver: box.update(error=_catch(receiver.receive))
            )
            thread.start()
            try:
                sender.stream_weights_via_ipc_zmq(buffer_size_bytes=64 << 10, timeout_s=10)
                outcomes.append("ok")
            except RefitError as exc:
                outcomes.append(str(exc)[:120])
            thread.join(10)
            if step == 0:
                kept = [s.path for s in sender._zmq()._kept]
                for path in kept:
                    os.truncate(path, 0)
        ok = outcomes == ["ok", "ok"] and receiver.version == 2
        say(
            trial,
            ok,
            f"{outcomes}; receiver version {receiver.version}; truncated {len(kept)} "
            f"file(s) in {ipc_files.SHM_DIR}",
        )
        receiver.close()
        sender.close()


def truncated_buffer_at_receiver(trials: int) -> None:
    """A same-user peer speaks the wire protocol to a receiver: a refit from a kept staging file,
    then the file is truncated and the next refit names it again. The receiver must reject it."""
    import zmq

    from policyworker.functional.buckets import TensorSpec
    from policyworker.functional.wire.codec import (
        Begin,
        Bucket,
        Complete,
        ShmBuffer,
        decode_reply,
        encode,
    )
    from policyworker.shell.refit.receiver import HFWeightReceiver
    from policyworker.shell.refit.zmq import ipc_files

    spec = TensorSpec("w", (1024,), torch.float32)
    for trial in range(trials):
        folder = tempfile.mkdtemp()
        address = f"ipc://{folder}/peer.sock"
        context = zmq.Context()
        peer = context.socket(zmq.REQ)
        peer.setsockopt(zmq.LINGER, 0)
        peer.setsockopt(zmq.RCVTIMEO, 10_000)
        peer.bind(address)
        name = f"pw-refit-{os.urandom(12).hex()}"
        path = os.path.join(ipc_files.SHM_DIR, name)
        with open(path, "wb") as f:
            f.write(torch.arange(1024, dtype=torch.float32).numpy().tobytes())
        got: list[torch.Tensor] = []
        receiver = HFWeightReceiver(
            lambda pairs, got=got: got.extend(t.clone() for _, t in pairs),
            address=address,
            refit_info={"w": (torch.Size([1024]), torch.float32)},
            timeout_s=10,
        )
        answers = []
        for step in range(2):
            box: dict[str, Any] = {}
            thread = threading.Thread(
                target=lambda box=box, receiver=receiver: box.update(error=_catch(receiver.receive))
            )
            thread.start()
            for message in (
                Begin(0, "shm", 256, (spec,)),
                Bucket(0, ShmBuffer(name, 4096, True), (0,), (0,), 4096),
                Complete(1),
            ):
                peer.send_multipart(encode(message))
                reply = decode_reply(peer.recv_multipart())
                answers.append(reply.ok)
                if not reply.ok:
                    break
            thread.join(10)
            if step == 0:
                os.truncate(path, 0)
        os.unlink(path)
        ok = (
            answers[:3] == [True, True, True]
            and answers[3:] == [True, False]
            and receiver.version == 1
        )
        say(
            trial,
            ok,
            f"replies ok {answers}; receiver version {receiver.version}; "
            f"second receive: {box.get('error')}",
        )
        receiver.close()
        peer.close(linger=0)
        context.term()


# ----------------------------------------------------------------------------- 18.11 smaller ones


SENDER_CHILD = r"""
import sys, threading
import torch
torch.set_num_threads(1)
from policyworker.shell.refit.receiver import HFWeightReceiver
from policyworker.shell.refit.sender import RefitSender
from tests.faults.scenarios import Weights
model = Weights(64)
sender = RefitSender(lambda: model, torch.float32, keep_staging=True)
receiver = HFWeightReceiver(lambda pairs: None, address=sender.get_zmq_address(),
                            refit_info=sender.prepare_refit_info(), timeout_s=10)
thread = threading.Thread(target=receiver.receive)
thread.start()
sender.stream_weights_via_ipc_zmq(buffer_size_bytes=64 << 10, timeout_s=10)
thread.join()
print("@@streamed", flush=True)
sys.stdin.readline()  # SIGKILLed while waiting here, its staging kept
"""


def killed_sender_leftovers(trials: int) -> None:
    """A sender keeping its staging is SIGKILLed; the next sender's start removes what it left
    (staging files in the shm folder, its socket folder), and nothing of a live sender."""
    from policyworker.shell.refit.sender import RefitSender
    from policyworker.shell.refit.zmq import ipc_files
    from tests.helpers import child_env

    def ours() -> set[str]:
        found = {os.path.join(ipc_files.SHM_DIR, n) for n in os.listdir(ipc_files.SHM_DIR)}
        found |= {os.path.join(tempfile.gettempdir(), n) for n in os.listdir(tempfile.gettempdir())}
        return {p for p in found if os.path.basename(p).startswith("pw-refit-")}

    live = RefitSender(lambda: Weights(), torch.float32)
    live_folder = os.path.dirname(live.get_zmq_address()[len("ipc://") :])
    for trial in range(trials):
        before = ours()
        env = child_env(TMPDIR=tempfile.gettempdir())
        child = subprocess.Popen(
            [sys.executable, "-c", SENDER_CHILD],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        line = child.stdout.readline()
        leaked = ours() - before
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        fresh = RefitSender(lambda: Weights(), torch.float32)
        fresh.get_zmq_address()  # the sender starts
        left = sorted(leaked & ours())
        ok = (
            line.startswith("@@streamed")
            and len(leaked) >= 2
            and not left
            and os.path.isdir(live_folder)
        )
        say(
            trial,
            ok,
            f"the killed sender had {len(leaked)} entries; left after the next start: {left}; "
            f"a live sender's folder kept: {os.path.isdir(live_folder)}",
        )
        fresh.close()
    live.close()


def unbounded_and_long(trials: int) -> None:
    """timeout_s=inf on both sides, and a sender socket path over 107 bytes."""
    from policyworker.shell.refit.receiver import HFWeightReceiver
    from policyworker.shell.refit.sender import RefitSender

    model = Weights()
    for trial in range(trials):
        problems = []
        sender = RefitSender(lambda: model, torch.float32)
        for call in (
            lambda sender=sender: sender.stream_weights_via_ipc_zmq(timeout_s=float("inf")),
            lambda sender=sender: HFWeightReceiver(
                lambda pairs: None,
                address=sender.get_zmq_address(),
                refit_info=sender.prepare_refit_info(),
                timeout_s=float("inf"),
            ).receive(),
        ):
            error = _catch(call)
            if not (isinstance(error, ValueError) and "timeout_s inf" in str(error)):
                problems.append(f"timeout_s=inf gave {type(error).__name__}: {error}")
        sender.close()
        old = tempfile.tempdir
        tempfile.tempdir = os.path.join(old or tempfile.gettempdir(), "d" * 100)
        os.makedirs(tempfile.tempdir, exist_ok=True)
        try:
            long = RefitSender(lambda: model, torch.float32)
            error = _catch(long.get_zmq_address)
            if not (isinstance(error, ValueError) and "107" in str(error)):
                problems.append(
                    f"a 100-byte TMPDIR: get_zmq_address gave {type(error).__name__}: {error}"
                )
                long.close()
        finally:
            shutil.rmtree(tempfile.tempdir, ignore_errors=True)
            tempfile.tempdir = old
        say(trial, not problems, "; ".join(problems))


def shut_down_worker(trials: int) -> None:
    """After shutdown(), a worker refuses to train and to open a refit address."""
    from policyworker.functional.loss import NLLLoss
    from policyworker.shell.worker.policy_worker import PolicyWorker
    from tests.shell.conftest import make_batch, make_config, save_tiny

    folder = save_tiny(tempfile.mkdtemp())
    for trial in range(trials):
        worker = PolicyWorker(make_config(folder), init_reference_model=False)
        first = worker.get_zmq_address()
        worker.shutdown()
        problems = []
        for name, call in (
            ("train", lambda worker=worker: worker.train(make_batch(), NLLLoss())),
            ("get_zmq_address", worker.get_zmq_address),
        ):
            try:
                got = call()
                problems.append(
                    f"{name} after shutdown returned {str(got)[:80]}"
                    + (" (a new address)" if got != first and name != "train" else "")
                )
            except Exception as exc:
                if "shut down" not in str(exc):
                    problems.append(f"{name} after shutdown raised {type(exc).__name__}: {exc}")
        if worker.is_alive():
            problems.append("is_alive() is True after shutdown")
        say(trial, not problems, "; ".join(problems))


SCENARIOS = {
    "shut_down_worker": shut_down_worker,
    "grad_mode_zmq": grad_mode_zmq,
    "grad_mode_sglang": grad_mode_sglang,
    "grad_mode_collective": grad_mode_collective,
    "close_while_receiving": close_while_receiving,
    "failed_construction": failed_construction,
    "dropped_in_a_cycle": dropped_in_a_cycle,
    "two_threads_one_sender": two_threads_one_sender,
    "retry_after_idle_timeout": retry_after_idle_timeout,
    "two_receivers_one_address": two_receivers_one_address,
    "oversized_messages": oversized_messages,
    "small_shm": small_shm,
    "truncated_kept_buffer": truncated_kept_buffer,
    "truncated_buffer_at_receiver": truncated_buffer_at_receiver,
    "killed_sender_leftovers": killed_sender_leftovers,
    "unbounded_and_long": unbounded_and_long,
}


def run_scenario(
    name: str, trials: int, *args: str, timeout_s: float = 120.0, env: dict[str, str] | None = None
) -> tuple[list[dict[str, Any]], int, str]:
    """Run a scenario in a fresh process: (per-trial results, exit code, stderr tail).
    A process killed by a signal has a negative exit code and fewer results than trials."""
    from tests.helpers import child_env

    proc = subprocess.run(
        [sys.executable, "-m", "tests.faults.scenarios", name, str(trials), *args],
        env=env or child_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    results = [json.loads(line[2:]) for line in proc.stdout.splitlines() if line.startswith("@@{")]
    return results, proc.returncode, proc.stderr[-2000:]


if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](int(sys.argv[2]), *sys.argv[3:])
