"""`policyworker grpo`: the run file's checks, the tokenizer path, checkpoints and exact resume,
on a tiny model with a word-level tokenizer (CPU, nothing downloaded)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from policyworker.errors import ConfigError
from policyworker.grpo import load_run_config, run_grpo
from policyworker.grpo.checkpoints import latest_committed
from policyworker.grpo.data import decode_responses, encode_prompt
from tests.helpers import child_env

ROOT = Path(__file__).resolve().parents[2]

REWARD = """
def even_words(prompts, responses, metadata):
    assert len(prompts) == len(responses) == len(metadata)
    assert all(m["tag"] == "x" for m in metadata)
    out = []
    for text in responses:
        words = text.split()
        out.append(sum(int(w[1:]) % 2 == 0 for w in words) / max(len(words), 1))
    return out
"""


def _run_file(folder: Path, model: str, **extra: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "my_reward.py").write_text(REWARD)
    rows = [{"prompt": f"t{3 + i} t{20 + i} t{40 + 2 * i}", "tag": "x"} for i in range(6)]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    body = f"""
    policy:
      model_name: {model}
      precision: float32
      train_global_batch_size: 8
      train_micro_batch_size: 4
      logprob_batch_size: 8
      optimizer: {{name: torch.optim.AdamW, kwargs: {{lr: 0.01, weight_decay: 0.0}}}}
      scheduler:
        - name: torch.optim.lr_scheduler.LinearLR
          kwargs: {{start_factor: 0.5, end_factor: 1.0, total_iters: 3}}
    loss_fn: {{reference_policy_kl_penalty: 0.05}}
    grpo: {{num_prompts_per_step: 2, num_generations_per_prompt: 4, max_num_steps: 4, seed: 3}}
    data: {{train_file: prompts.jsonl}}
    env: {{reward_fn: "my_reward:even_words"}}
    generation: {{max_new_tokens: 3}}
    checkpointing:
      checkpoint_dir: {folder / "ckpt"}
      save_period: 2
      keep_top_k: 1
    logger: {{log_dir: {folder / "logs"}}}
    """
    path = folder / "run.yaml"
    path.write_text(textwrap.dedent(body) + "".join(f"{k}: {v}\n" for k, v in extra.items()))
    return path


def test_every_problem_is_listed_with_its_path_before_anything_starts(tmp_path):
    path = _run_file(tmp_path, "/no/model")
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom at import')\n")
    overrides = [
        "policy.train_micro_batch_size=x",
        "+loss_fn.ratio_clip_mn=0.2",  # added as written: a typo the checks name
        "grpo.num_prompts_per_step=0",
        "env.reward_fn=broken:fn",
        "data.train_file=nope.jsonl",
        "++generation.backend=sglang",
        "++checkpointing.metric_name=train:nothing",
    ]
    with pytest.raises(ConfigError) as info:
        load_run_config(path, overrides)
    text = str(info.value)
    assert "(7 problems)" in text, text
    for where in (
        "@ policy.train_micro_batch_size",
        "did you mean 'ratio_clip_min'",
        "@ grpo.num_prompts_per_step",
        "@ generation.backend",
        "@ checkpointing.metric_name",
        "nope.jsonl",
    ):
        assert where in text
    assert "'broken:fn': importing 'broken' failed: RuntimeError: boom at import" in text


def test_overrides_that_cannot_apply_are_listed_with_the_other_problems(tmp_path):
    path = _run_file(tmp_path, "/no/model")
    overrides = ["grpo.max_num_stepz=3", "policy.optimizer.kwargs.lrr=1", "oops", "grpo.seed=-1"]
    with pytest.raises(ConfigError) as info:
        load_run_config(path, overrides)
    text = str(info.value)
    assert "(4 problems)" in text, text
    assert "did you mean 'grpo.max_num_steps'?" in text and "@ grpo.max_num_stepz" in text
    # a policy key's fix is written with its full path, as this runner's overrides take it
    assert "write '+policy.optimizer.kwargs.lrr=...' @ policy.optimizer.kwargs.lrr" in text
    assert "override 'oops' must look like dotted.key=value" in text
    assert "@ grpo.seed" in text


def test_missing_sections_and_keys_say_what_to_add(tmp_path):
    (tmp_path / "run.yaml").write_text("policy: {model_name: /x}\ndata: {prompt_key: q}\n")
    with pytest.raises(ConfigError) as info:
        load_run_config(tmp_path / "run.yaml")
    text = str(info.value)
    assert "(2 problems)" in text, text
    assert "required field missing; add train_file: " in text and "@ data.train_file" in text
    assert "required field missing; add env: {reward_fn: " in text and text.endswith("@ env")


def test_missing_reward_function_and_bad_rows_are_named(tmp_path):
    path = _run_file(tmp_path, "/no/model")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "t3"}\n{"text": "t4"}\nnot json\n')
    with pytest.raises(ConfigError) as info:
        load_run_config(path, ["env.reward_fn=my_reward:absent", "grpo.num_prompts_per_step=3"])
    text = str(info.value)
    assert "has no function 'absent'" in text
    assert "line 2: no text field 'prompt'" in text and "line 3: not JSON" in text
    assert "is not a multiple of policy.train_global_batch_size = 8" in text
    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    with pytest.raises(ConfigError, match="p.parquet'?: not a readable Parquet file") as info:
        load_run_config(path, ["data.train_file=p.parquet"])
    assert "@ data.train_file" in str(info.value)


def test_parquet_prompts_read_as_jsonl_ones_do(tmp_path, tiny_tokenizer_model_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from policyworker.grpo.data import load_prompts

    path = _run_file(tmp_path, tiny_tokenizer_model_path)
    rows = [json.loads(x) for x in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    pq.write_table(
        pa.Table.from_pylist([{**r, "n": i} for i, r in enumerate(rows)]), tmp_path / "p.parquet"
    )
    run = load_run_config(path, ["data.train_file=p.parquet"])
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_model_path)
    data = load_prompts(run.sections.data, base_dir=run.base_dir, tokenizer=tok)
    jsonl = load_prompts(load_run_config(path).sections.data, base_dir=run.base_dir, tokenizer=tok)
    assert data.texts == jsonl.texts and data.token_ids == jsonl.token_ids
    assert data.metadata[4] == {"tag": "x", "n": 4}

    pq.write_table(pa.table({"prompt": ["t3", None], "id": [1, 2]}), tmp_path / "gap.parquet")
    with pytest.raises(ConfigError) as info:
        load_run_config(path, ["data.train_file=gap.parquet"])
    assert "row 2: no text field 'prompt' @ data.train_file" in str(info.value)


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    from policyworker.grpo.loading import read_prompt_rows

    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    for name in [m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow...` raises ImportError
    with pytest.raises(ConfigError, match=r"needs pyarrow .*pip install 'policyworker\[grpo\]'"):
        read_prompt_rows(tmp_path / "p.parquet", prompt_key="prompt")


def test_prompts_use_the_chat_template_when_the_tokenizer_has_one(tiny_tokenizer_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_model_path)
    assert encode_prompt(tok, "t5 t9", use_chat_template=True) == [5, 9]
    tok.chat_template = "{% for m in messages %}t3 {{ m['content'] }} t4{% endfor %}"
    assert encode_prompt(tok, "t5 t9", use_chat_template=True) == [3, 5, 9, 4]
    assert encode_prompt(tok, "t5 t9", use_chat_template=False) == [5, 9]
    assert decode_responses(tok, [[5, 9, 1]]) == ["t5 t9"]


def test_policy_tokenizer_chat_template_is_read_as_nemo_rl_reads_it(
    tmp_path, tiny_tokenizer_model_path
):
    from policyworker.config import load_config
    from policyworker.grpo.data import PASSTHROUGH_TEMPLATE, load_tokenizer

    def encoded(template, **kwargs):
        policy = load_config(
            {"model_name": tiny_tokenizer_model_path, "tokenizer": {"chat_template": template}}
        )
        tok = load_tokenizer(policy, base_dir=str(tmp_path))
        return tok, encode_prompt(tok, "t5 t9", use_chat_template=True, template_kwargs=kwargs)

    (tmp_path / "turn.jinja").write_text(
        "{% for m in messages %}{% if wrap %}t3 {% endif %}{{ m['content'] }} t4{% endfor %}"
    )
    assert encoded("turn.jinja", wrap=True)[1] == [3, 5, 9, 4]  # relative to the run file
    assert encoded("turn.jinja", wrap=False)[1] == [5, 9, 4]  # chat_template_kwargs reach it
    assert encoded("t6 {{ messages[0]['content'] }}")[1] == [6, 5, 9]  # a literal template
    tok, ids = encoded(None)
    assert tok.chat_template == PASSTHROUGH_TEMPLATE and ids == [5, 9]
    assert encoded("default")[0].chat_template is None  # the tiny tokenizer has none

    path = _run_file(tmp_path, tiny_tokenizer_model_path)
    with pytest.raises(ConfigError) as info:
        load_run_config(path, ["++policy.tokenizer.chat_template=absent.jinja"])
    text = str(info.value)
    assert "no such file" in text and text.endswith("@ policy.tokenizer.chat_template")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


SAME = ("reward_mean", "reward_std", "loss", "kl", "response_len_mean")


@pytest.mark.slow
def test_a_run_killed_after_step_3_resumes_exactly(tmp_path, tiny_tokenizer_model_path, capsys):
    # The same run in a fresh interpreter, killed (SIGKILL, with its inference process) once it
    # printed step 3: step 2's save is committed, step 3 was logged but never saved. It runs
    # while this process makes the whole run (they share nothing but the model folder), and the
    # kill comes from the thread reading its output, the moment step 3 is printed.
    cut = _run_file(tmp_path / "cut", tiny_tokenizer_model_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "policyworker", "grpo", "--config", str(cut)],
        cwd=tmp_path,
        env=child_env(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = []

    def read_until_step_3() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("step 3/4"):
                break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    reader = threading.Thread(target=read_until_step_3, daemon=True)
    watchdog = threading.Timer(240, os.killpg, (proc.pid, signal.SIGKILL))
    watchdog.start()
    reader.start()
    try:
        whole = _run_file(tmp_path / "whole", tiny_tokenizer_model_path)
        summary = run_grpo(load_run_config(whole))
        assert summary["steps"] == 4
        full = _jsonl(tmp_path / "whole/logs/metrics.jsonl")
        assert [m["step"] for m in full] == [1, 2, 3, 4]
        assert len({m["reward_mean"] for m in full}) > 1 and any(m["loss"] != 0 for m in full)
        reader.join(timeout=240)
    finally:
        watchdog.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        reader.join(timeout=60)
    assert any(line.startswith("step 3/4") for line in seen), "".join(seen)[-4000:]
    ckpt = tmp_path / "cut/ckpt"
    assert (latest_committed(ckpt) or (0,))[0] == 2

    capsys.readouterr()
    resumed = run_grpo(load_run_config(cut))
    out = capsys.readouterr().out
    assert "resuming after step 2" in out and "step 3/4" in out and "step 1/4" not in out
    again = _jsonl(tmp_path / "cut/logs/metrics.jsonl")
    assert [m["step"] for m in again] == [1, 2, 3, 4]
    for a, b in zip(full, again, strict=True):
        assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}, a["step"]
    assert resumed["reward_last"] == summary["reward_last"] and resumed["steps"] == 4
    # keep_top_k 1 over the committed steps 2 and 4: the better one and the latest stay.
    kept = sorted(p.name for p in ckpt.iterdir())
    assert "step_4" in kept and len(kept) <= 2

    # Nothing left to do: a third start runs no step.
    assert run_grpo(load_run_config(cut))["steps"] == 4


class _FakeWorker:
    """Writes the folders a save would, synchronously."""

    def __init__(self):
        self.finalized = 0

    def save_checkpoint(self, weights, optimizer):
        Path(weights).mkdir(parents=True)
        Path(optimizer).mkdir(parents=True)

    def finalize_async_save(self):
        self.finalized += 1


def test_checkpoints_commit_after_the_save_and_keep_the_top_k_and_the_latest(tmp_path):
    from policyworker.grpo.checkpoints import Checkpointer, committed_steps
    from policyworker.grpo.config import CheckpointingSection

    section = CheckpointingSection(checkpoint_dir=str(tmp_path), save_period=2, keep_top_k=2)
    worker = _FakeWorker()
    saver = Checkpointer(section, worker)
    assert [s for s in range(1, 8) if saver.due(s, last_step=7)] == [2, 4, 6, 7]
    for step, reward in ((2, 0.9), (4, 0.1), (6, 0.5), (7, 0.2)):
        saver.save(step, {"step": step, "metrics": {"reward_mean": reward}, "history": []})
        assert step not in committed_steps(tmp_path)  # not before it is finalised
    saver.commit()
    assert worker.finalized == 4
    assert sorted(committed_steps(tmp_path)) == [2, 6, 7]
    assert (latest_committed(tmp_path) or (0,))[0] == 7


def test_keep_top_k_ranks_by_the_configured_metric_and_direction(tmp_path):
    from policyworker.grpo.checkpoints import Checkpointer, committed_steps
    from policyworker.grpo.config import CheckpointingSection

    section = CheckpointingSection(
        checkpoint_dir=str(tmp_path),
        save_period=1,
        keep_top_k=1,
        metric_name="train:loss",
        higher_is_better=False,
    )
    saver = Checkpointer(section, _FakeWorker())
    for step, loss in ((1, 0.5), (2, 0.1), (3, 0.9), (4, 0.7)):
        # the loop stores the ranking metric under its name without the "train:" prefix
        saver.save(step, {"step": step, "metrics": {"loss": loss}, "history": []})
    saver.commit()
    assert sorted(committed_steps(tmp_path)) == [2, 4]  # the lowest loss, and the latest


def test_epochs_bound_the_steps_and_metadata_keys_pick_the_fields(
    tmp_path, tiny_tokenizer_model_path
):
    import importlib.util

    from transformers import AutoTokenizer

    from policyworker.grpo.data import load_prompts
    from policyworker.grpo.loop import last_step

    path = _run_file(tmp_path, tiny_tokenizer_model_path)
    run = load_run_config(path, ["++grpo.max_num_epochs=1", "grpo.max_num_steps=100"])
    assert last_step(run, 6) == 3  # 6 prompts, 2 per step, one epoch
    assert last_step(load_run_config(path), 6) == 4
    run = load_run_config(path, ["+data.metadata_keys=[tag, missing]"])
    data = load_prompts(
        run.sections.data,
        base_dir=run.base_dir,
        tokenizer=AutoTokenizer.from_pretrained(tiny_tokenizer_model_path),
    )
    assert data.token_ids[0] == (3, 20, 40) and data.texts[0] == "t3 t20 t40"
    assert data.metadata[0] == {"tag": "x", "missing": None}
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ConfigError, match="tensorboard is not installed"):
            load_run_config(path, ["++logger.tensorboard_enabled=true"])
