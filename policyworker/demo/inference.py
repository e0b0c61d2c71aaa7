"""The demo's inference process: its own copy of the model, refit over ZMQ, sampling, scoring.

`InferenceProcess` (trainer side) spawns `serve` in a fresh interpreter (multiprocessing
"spawn"), which loads the model from the same folder as the trainer, one intra-op thread.
Requests and results travel over a `multiprocessing.Pipe` as plain lists and strings (token ids,
fp32 logprobs as Python floats, which round-trip exactly); model weights never do: every update
arrives through `HFWeightReceiver` from the trainer's ZMQ refit stream.

Requests (op, payload) -> replies ("ok", payload) or ("error", message):
- `connect` {address, refit_info (`encode_refit_info`'s form), timeout_s, inflight?}: build the
  receiver; with ``inflight`` an `InflightWeights` that stages every refit in the background
  while this process samples (the trainer then just streams; no `refit` request).
- `refit` {}: serve one refit; reply {version, num_bytes, num_tensors}.
- `generate` {prompts, response_len, seed, score_micro_batch_size, temperature? (1),
  score_version?, timeout_s?}: sample `response_len` tokens per prompt row at `temperature`
  (no KV cache; an in-flight receiver's staged version
  is swapped in between two decode steps), then score the whole rows with a plain HF forward +
  fp32 log_softmax under the newest version (in flight: first wait for refit
  ``score_version``); reply {responses, generation_logprobs,
  generation_versions (each token's weight version), swaps [(version, seconds)],
  served_version, logprobs}.
- `close` {}: exit.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import signal
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import attrs
import torch

from policyworker.functional.dtypes import decode_refit_info

if TYPE_CHECKING:  # the refit stack (zmq) loads in the inference process, not the trainer's
    from policyworker.shell.refit.inflight import InflightWeights, Swap

__all__ = ["InferenceError", "InferenceProcess", "Sampled", "generate_tagged", "serve"]

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
    "uint8": torch.uint8,
}


class InferenceError(RuntimeError):
    """The inference process failed or did not answer in time."""


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _load_model(model_dir: str, device: str, dtype_name: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    pretrained = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=_DTYPES[dtype_name], attn_implementation="sdpa"
    )
    pretrained.config.use_cache = False
    # A plain Module to pyright: transformers types `.to` of the auto class as the generate
    # mixin's, which takes no device.
    model = cast("torch.nn.Module", pretrained)
    return model.to(device).eval()


@torch.no_grad()
def _logprobs_of_rows(
    model: torch.nn.Module, ids_NS: torch.Tensor, micro_batch_size: int
) -> torch.Tensor:
    """[N, S] fp32: column 0 is 0, column t is log p(x_t | x_<t) (plain forward + log_softmax)."""
    out = torch.zeros(ids_NS.shape, dtype=torch.float32)
    for start in range(0, ids_NS.shape[0], micro_batch_size):
        ids = ids_NS[start : start + micro_batch_size]
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
        picked = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        out[start : start + ids.shape[0], 1:] = picked.cpu()
    return out


@torch.no_grad()
def _generate(
    model: torch.nn.Module,
    prompts_NL: torch.Tensor,
    response_len: int,
    seed: int,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `response_len` tokens per row at `temperature`; returns ([N, Lr] tokens, [N, S]
    sampler logprobs, of the temperature-scaled distribution)."""
    sampled = generate_tagged(model, prompts_NL, response_len, seed, temperature=temperature)
    return sampled.tokens, sampled.generation_logprobs


@attrs.frozen
class Sampled:
    """One generation: ``tokens`` [N, Lr], ``generation_logprobs`` [N, S] (prompt columns 0),
    ``versions`` [N, S] int64 (the weight version that sampled each token; prompt columns carry
    the first sampled token's) and the ``swaps`` made between its decode steps."""

    tokens: torch.Tensor
    generation_logprobs: torch.Tensor
    versions: torch.Tensor
    swaps: tuple[Swap, ...]


@torch.no_grad()
def generate_tagged(
    model: torch.nn.Module,
    prompts_NL: torch.Tensor,
    response_len: int,
    seed: int,
    *,
    weights: InflightWeights | None = None,
    between_steps: Callable[[int], None] | None = None,
    temperature: float = 1.0,
) -> Sampled:
    """Sample `response_len` tokens per row at `temperature` (no KV cache: every step reads the
    whole prefix, so a swap needs no cache recomputed); before each decode step,
    ``between_steps(t)`` runs, then ``weights.swap()`` makes a staged version live."""
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = prompts_NL.to(device)
    n, lp = prompts_NL.shape
    gen_lp = torch.zeros(n, lp + response_len, dtype=torch.float32)
    versions = torch.zeros(n, lp + response_len, dtype=torch.int64)
    swaps: list[Swap] = []
    for t in range(response_len):
        if between_steps is not None:
            between_steps(t)
        if weights is not None and (swap := weights.swap()) is not None:
            swaps.append(swap)
        logits = model(input_ids=ids, use_cache=False).logits[:, -1].float().cpu()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=g)
        gen_lp[:, lp + t] = logp.gather(-1, tok)[:, 0]
        versions[:, lp + t] = weights.version if weights is not None else 0
        ids = torch.cat([ids, tok.to(device)], dim=1)
    first = versions[:, lp : lp + 1] if response_len else versions[:, :1]
    versions[:, :lp] = first
    return Sampled(ids[:, lp:].cpu(), gen_lp, versions, tuple(swaps))


def serve(
    conn: multiprocessing.connection.Connection,
    model_dir: str,
    device: str,
    dtype_name: str,
    idle_timeout_s: float,
) -> None:
    """Body of the inference process: answer requests until `close` or the trainer is gone.

    A quiet trainer is not a gone one: starting a Ray group can take minutes before the first
    request, so each `idle_timeout_s` without a request only checks that the trainer process
    still runs (its end of the pipe closing, or its exit, ends the loop)."""
    torch.set_num_threads(1)
    _quiet_transformers()
    try:
        model = _load_model(model_dir, device, dtype_name)
    except Exception as exc:  # reported to the trainer, which raises InferenceError
        conn.send(("error", f"loading {model_dir}: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", {"device": str(next(model.parameters()).device)}))
    receiver = None
    try:
        while True:
            if not conn.poll(idle_timeout_s):
                if _trainer_alive():
                    continue
                break
            try:
                op, payload = conn.recv()
            except EOFError:  # the trainer closed its end: it exited
                break
            if op == "close":
                break
            try:
                if op == "connect":
                    receiver = _connect(model, payload)
                    reply: dict[str, Any] = {}
                elif op == "refit":
                    reply = _refit(receiver)
                elif op == "generate":
                    reply = _generate_reply(model, payload, receiver)
                else:
                    raise InferenceError(f"unknown op {op!r}")
                conn.send(("ok", reply))
            except Exception as exc:  # every request gets an answer; the trainer raises it
                conn.send(("error", f"{op}: {type(exc).__name__}: {exc}"))
    finally:
        if receiver is not None:
            receiver.close()
        conn.close()


def _connect(model: torch.nn.Module, payload: dict[str, Any]) -> Any:
    """The receiver `connect` asks for: in-place (refits wait for `refit`), or with
    ``inflight`` an `InflightWeights` serving refits in the background from now on."""
    info = decode_refit_info(payload["refit_info"])
    if payload.get("inflight"):
        from policyworker.shell.refit.inflight import InflightWeights

        weights = InflightWeights(
            model, address=payload["address"], refit_info=info, timeout_s=payload["timeout_s"]
        )
        weights.start()
        return weights
    from policyworker.shell.refit.receiver import HFWeightReceiver

    return HFWeightReceiver(
        model, address=payload["address"], refit_info=info, timeout_s=payload["timeout_s"]
    )


def _refit(receiver: Any) -> dict[str, Any]:
    """Serve one refit (in-place receiver); an in-flight one serves them by itself."""
    if receiver is None:
        raise InferenceError("refit before connect; send connect first")
    if not hasattr(receiver, "receive"):
        msg = "refit: this receiver serves refits in flight (connect inflight=True); just send"
        raise InferenceError(msg)
    report = receiver.receive()
    return {
        "version": report.version,
        "num_bytes": report.num_bytes,
        "num_tensors": report.num_tensors,
    }


def _generate_reply(model: torch.nn.Module, payload: dict[str, Any], receiver: Any) -> dict:
    """Sample (swapping in-flight versions between decode steps), then score the rows with the
    weights serving at the end."""
    prompts = torch.tensor(payload["prompts"], dtype=torch.int64)
    inflight = receiver if receiver is not None and hasattr(receiver, "swap") else None
    sampled = generate_tagged(
        model,
        prompts,
        payload["response_len"],
        payload["seed"],
        weights=inflight,
        temperature=payload.get("temperature", 1.0),
    )
    if inflight is not None and payload.get("score_version"):
        # the trainer's refit still streaming when sampling ended: score under it, not before
        version = payload["score_version"]
        if not inflight.wait(received=version, timeout_s=payload.get("timeout_s", 120.0)):
            msg = f"refit {version} did not arrive (received {inflight.received})"
            raise InferenceError(msg)
    if inflight is not None and (swap := inflight.swap()) is not None:  # score the newest
        sampled = attrs.evolve(sampled, swaps=(*sampled.swaps, swap))
    ids = torch.cat([prompts, sampled.tokens], dim=1).to(next(model.parameters()).device)
    scored = _logprobs_of_rows(model, ids, payload["score_micro_batch_size"])
    return {
        "responses": sampled.tokens.tolist(),
        "generation_logprobs": sampled.generation_logprobs.tolist(),
        "generation_versions": sampled.versions.tolist(),
        "swaps": [(s.version, s.seconds) for s in sampled.swaps],
        "served_version": inflight.version if inflight is not None else None,
        "logprobs": scored.tolist(),
    }


def _trainer_alive() -> bool:
    parent = multiprocessing.parent_process()  # None only when not started by multiprocessing
    return parent is None or parent.is_alive()


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """A process started inside inherits SIGINT as ignored (it survives exec): a Ctrl-C in a
    terminal reaches the whole process group, and this child is ended by the trainer's `close`
    (or by noticing the trainer is gone), not by a traceback of its own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class InferenceProcess:
    """Trainer-side handle of the inference process; every wait is bounded by `timeout_s`."""

    def __init__(
        self,
        model_dir: str,
        *,
        device: str = "cpu",
        dtype_name: str = "float32",
        timeout_s: float = 120.0,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.timeout_s = timeout_s
        self._proc = ctx.Process(
            target=serve,
            args=(child, model_dir, device, dtype_name, timeout_s),
            name="policyworker-demo-inference",
            daemon=True,
        )
        with _sigint_ignored():
            self._proc.start()
        child.close()
        self._ready = False

    def _reply(self, what: str) -> dict[str, Any]:
        if not self._conn.poll(self.timeout_s):
            msg = (
                f"inference process gave no answer to {what!r} within {self.timeout_s:.0f} s "
                f"(alive: {self._proc.is_alive()}, exit code: {self._proc.exitcode})"
            )
            raise InferenceError(msg)
        try:
            status, payload = self._conn.recv()
        except EOFError:
            msg = f"inference process exited (code {self._proc.exitcode}) while answering {what!r}"
            raise InferenceError(msg) from None
        if status != "ok":
            raise InferenceError(f"inference process: {payload}")
        return payload

    def wait_ready(self) -> dict[str, Any]:
        if not self._ready:
            self._ready_info = self._reply("startup")
            self._ready = True
        return self._ready_info

    def request(self, op: str, **payload: Any) -> None:
        """Send a request without waiting (e.g. `refit`, answered by `result`)."""
        self.wait_ready()
        try:
            self._conn.send((op, payload))
        except OSError as exc:  # BrokenPipeError: the process is gone
            self._proc.join(timeout=1)
            msg = (
                f"inference process exited (code {self._proc.exitcode}) before the {op!r} "
                f"request could be sent ({type(exc).__name__}: {exc}); its own error, if any, "
                "is above in this log"
            )
            raise InferenceError(msg) from exc

    def result(self, what: str) -> dict[str, Any]:
        return self._reply(what)

    def call(self, op: str, **payload: Any) -> dict[str, Any]:
        self.request(op, **payload)
        return self._reply(op)

    def close(self) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self._conn.send(("close", {}))
            self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=10)
        self._conn.close()
