"""Helpers shared by the shell tests: tiny MoE configs, a JSON-commanded child process, and a
worker's checkpointed state for comparing saves."""

from __future__ import annotations

import json
import os
import pathlib
import queue
import subprocess
import sys
import threading
from collections.abc import Sequence

# The shape of the tiny dense decoders the multi-process tests build (Llama / Qwen2 / Qwen3).
TINY_DECODER_SHAPE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def save_tiny_llama(folder) -> str:
    """Write the tiny Llama the multi-process tests share (seed 0, TINY_DECODER_SHAPE, matrices
    from N(0, 0.2)) to `folder`; return its path."""
    from policyworker.testing import tiny_model_folder

    return tiny_model_folder(folder, "llama", init_std=0.2, **TINY_DECODER_SHAPE)


def tiny_qwen2_config(folder, *, tie: bool = True):
    """The tiny decoder shape as a Qwen2 config, saved in `folder` (receivers load it there)."""
    from policyworker.testing import tiny_config

    cfg = tiny_config("qwen2", **TINY_DECODER_SHAPE, tie_word_embeddings=tie)
    cfg.save_pretrained(folder)
    return cfg


def eager_model(cfg, seed: int):
    """A random causal LM of `cfg` with eager attention, in eval mode.

    Same bits in every process.
    """
    import torch
    from transformers import AutoModelForCausalLM

    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def write_refit_info(info, path) -> None:
    """`{name: (shape, dtype)}` refit metadata as the JSON the receiver children read."""
    with open(path, "w") as f:
        json.dump({n: (list(s), str(d).removeprefix("torch.")) for n, (s, d) in info.items()}, f)


def single_thread_logprobs(model, ids):
    """fp32 log-softmax of `model(ids)` on one intra-op thread, as the receiver children compute
    it: same kernels, same bits."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return torch.log_softmax(model(ids).logits.float(), -1)
    finally:
        torch.set_num_threads(threads)


def tiny_deepseek_v3_config():
    """A 2-layer DeepSeek-V3 (MLA, 4 routed + 1 shared expert).

    Layer 1 is MoE with an fp32 router.
    """
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        vocab_size=128,
    )


def child_env(root: str | os.PathLike | None = None, **extra: str) -> dict[str, str]:
    """This environment for a child Python: one intra-op thread, the repo first on PYTHONPATH,
    and the caller's PYTHONPATH kept (the device machine carries packages there)."""
    path = os.pathsep.join(
        p for p in (str(root or os.getcwd()), os.environ.get("PYTHONPATH", "")) if p
    )
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def run_script(path, source: str, root, *, timeout: float) -> subprocess.CompletedProcess:
    """Write `source` to `path` and run it as a child Python in `path`'s folder (`child_env`);
    its output is captured and the exit status left to the caller."""
    path.write_text(source)
    return subprocess.run(
        [sys.executable, str(path)],
        cwd=path.parent,
        env=child_env(root),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


class ChildRun:
    """A child process started at once, its output going to files in `log_dir`, so a module can
    start its independent child runs together and each test wait for its own: a child Python
    spends seconds importing on one core while the test process waits, and CI has two cores.
    Files, not pipes: a child never blocks on a full pipe no one reads yet."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        cwd: str | os.PathLike,
        env: dict[str, str],
        log_dir: pathlib.Path,
        name: str,
    ) -> None:
        self.args = list(args)
        self._out, self._err = log_dir / f"{name}.stdout", log_dir / f"{name}.stderr"
        with self._out.open("w") as out, self._err.open("w") as err:
            self.proc = subprocess.Popen(self.args, cwd=cwd, env=env, stdout=out, stderr=err)

    def result(self, *, timeout: float) -> subprocess.CompletedProcess[str]:
        """The finished run, as `subprocess.run(..., capture_output=True, text=True)` gives it;
        past `timeout` seconds of waiting the child is killed and `TimeoutExpired` raised."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return subprocess.CompletedProcess(
            self.args, self.proc.returncode, self._out.read_text(), self._err.read_text()
        )

    def kill(self) -> None:
        """End the child if it still runs (a module's teardown: a test that never waited)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)


# `policyworker demo`'s short run in tests: three steps, no reward rise asked for, one seed.
SHORT_DEMO_FLAGS = ("--steps", "3", "--no-require-rise", "--seed", "1")


def run_three_step_demo(
    *flags: str,
    root: str | os.PathLike,
    env: dict[str, str],
    timeout: float,
    launcher: Sequence[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`policyworker demo <flags> --steps 3 --no-require-rise --seed 1` in a fresh process run
    from `root` (`launcher`, e.g. torchrun and its options, instead of this Python)."""
    return subprocess.run(
        [*(launcher or [sys.executable]), "-m", "policyworker", "demo", *flags, *SHORT_DEMO_FLAGS],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


class JsonCommandChild:
    """A child Python process running `script`, driven by JSON lines on stdin.

    The script answers with lines prefixed '@@' followed by a JSON object; other output is ignored.
    When the child exits, a final {"ok": False, "error": "exited"} reply is queued.
    """

    def __init__(self, script: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self.lines.put(json.loads(line[2:]))
        self.lines.put({"ok": False, "error": "exited", "returncode": self.proc.wait()})

    def send(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout=120):
        return self.lines.get(timeout=timeout)

    def close(self):
        if self.proc.poll() is None:
            self.send(op="exit")
            self.proc.wait(timeout=30)


def tiny_qwen3_moe_config():
    """A 2-layer Qwen3-MoE (4 experts, top-2, softmax router); both layers are MoE."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )


def tiny_mixtral_config():
    """A 2-layer Mixtral (4 experts, top-2, softmax router renormalized); both layers are MoE."""
    from transformers import MixtralConfig

    return MixtralConfig(
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )


def own_moe_routes(model, routers, data):
    """[B, S, MoE layers, top_k]: the experts `model` picks for each real token of `data` (one
    full-batch forward, hooks on `routers`, the worker's `_moe.routers`); -1 at padding."""
    import torch

    ids = data["input_ids"]
    seen = []
    handles = [
        r.module.register_forward_hook(lambda _m, _a, out: seen.append(out[2].clone()))
        for r in routers
    ]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    routes = torch.stack([s.reshape(*ids.shape, -1) for s in seen], dim=2)
    valid = torch.arange(ids.shape[1])[None] < data["input_lengths"][:, None]
    return torch.where(valid[..., None, None], routes, torch.full_like(routes, -1))


def router_weight_dtype(model, dtype):
    """The dtype a bf16/fp16 refit sends a DeepSeek-V3 router weight in: fp32 when the installed
    transformers keeps `gate.weight` in fp32 (5.2x lists it; 5.19 keeps only the bias)."""
    import torch

    from policyworker.shell.refit.weight_stream import keep_fp32_patterns

    return torch.float32 if "gate.weight" in keep_fp32_patterns(model) else dtype


def hf_built_dtype(config, name: str, dtype):
    """The dtype transformers gives tensor `name` of a model built from `config` in `dtype`, as
    the receiving children build theirs (5.2x keeps the DeepSeek-V3 router bias fp32; 5.19
    builds it in `dtype`)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.state_dict()[name].dtype


def checkpoint_state(worker):
    """(weights, per-parameter optimizer state) of a worker or its state, cloned, as a save
    holds them."""
    import torch

    weights = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
    optim = [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
        for s in worker.optimizer.state_dict()["state"].values()
    ]
    return weights, optim


def assert_same_checkpoint_state(a, b) -> None:
    """Two `checkpoint_state`s are bit-identical (compared on the CPU, any device)."""
    import torch

    (aw, ao), (bw, bo) = a, b
    assert aw.keys() == bw.keys() and all(torch.equal(aw[k].cpu(), bw[k].cpu()) for k in aw)
    assert len(ao) == len(bo)
    for x, y in zip(ao, bo, strict=True):
        assert x.keys() == y.keys()
        assert all(torch.equal(torch.as_tensor(x[k]).cpu(), torch.as_tensor(y[k]).cpu()) for k in x)


def safetensors_shards(folder) -> dict[str, bytes]:
    """The bytes of each weight shard under `folder`/model, by file name."""
    import pathlib

    model = pathlib.Path(folder) / "model"
    return {p.name: p.read_bytes() for p in sorted(model.glob("*.safetensors"))}


def optimizer_tensor_bytes(optimizer, *, cuda_only: bool = False) -> int:
    """Bytes of the tensors in an optimizer's per-parameter state (those on CUDA only, if so)."""
    import torch

    return sum(
        t.nbytes
        for s in optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and (t.is_cuda or not cuda_only)
    )


def serve_refit_in_thread(receiver):
    """`receiver.receive()` on a thread: (the thread, a box that gets "report" or "error")."""
    box: dict = {}

    def run():
        try:
            box["report"] = receiver.receive()
        except Exception as exc:  # surfaced by the test
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


def refit_through(sender, receiver, **kwargs):
    """One ZMQ refit from `sender` into `receiver` served on a thread: (the sender's report,
    the receiver's box)."""
    thread, box = serve_refit_in_thread(receiver)
    try:
        return sender.stream_weights_via_ipc_zmq(timeout_s=30, **kwargs), box
    finally:
        thread.join(30)


def save_float8_tiny_qwen2(folder) -> str:
    """A tiny Qwen2 for the float8 tests, saved in `folder`: every linear's dims divisible by 16
    (k/v projections: 2 heads of 16), and transformers' default init (N(0, 0.02)). The session
    models' N(0, 0.2) matrices amplify float8 rounding from layer to layer far beyond what
    trained weights do."""
    from policyworker.testing import tiny_model_folder

    shape = dict(TINY_DECODER_SHAPE, hidden_size=64, intermediate_size=128)
    return tiny_model_folder(folder, "qwen2", seed=3, **shape)
