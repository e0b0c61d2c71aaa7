"""`policyworker info`, argument errors, the bench runner and the generated config reference."""

import json
import math
import sys
import textwrap
from pathlib import Path

import pytest

from policyworker import cli
from policyworker._dev import bench_runner, bench_table, docs_gen

ROOT = Path(__file__).resolve().parents[2]


def test_info_reports_versions_devices_kernels_and_transports(capsys):
    info = cli.collect_info()
    assert info["versions"]["policyworker"] == __import__("policyworker").__version__
    assert info["versions"]["torch"] and info["versions"]["transformers"]
    assert info["attention"]["sdpa"] is True
    assert info["transports"]["zmq"] is True and info["transports"]["gloo"] is True
    if info["devices"]["cuda_count"] == 0:
        assert not info["transports"]["cuda_ipc"] and not info["attention"]["varlen"]
    json.dumps(info)  # plain data
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for word in (
        "policyworker",
        "torch",
        "transformers",
        "sdpa",
        "varlen",
        "flex_attention",
        "flash-attn",
        "zmq",
        "shared memory",
        "CUDA IPC",
        "gloo",
        "NCCL",
    ):
        assert word in out


def test_info_names_each_engine_and_extra_with_its_version_or_not_installed(capsys, monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version

    def version(dist):
        if dist == "sglang":
            raise importlib.metadata.PackageNotFoundError(dist)
        return "9.9.9" if dist in ("vllm", "ray", "peft") else real(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    info = cli.collect_info()
    assert info["extras"] == {"vllm": "9.9.9", "ray": "9.9.9", "sglang": None, "peft": "9.9.9"}
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "vllm 9.9.9, ray 9.9.9, sglang not installed, peft 9.9.9" in out


def test_version_flag_prints_the_package_version_and_exits_0(capsys):
    import policyworker

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"policyworker {policyworker.__version__}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--steps", "0"], "--steps: 0 must be >= 1"),
        (["demo", "--seed", "-1"], "--seed: -1 must be >= 0"),
        (["demo", "--precision", "fp8"], "invalid choice: 'fp8'"),
        (["demo", "--device", "tpu"], "invalid choice: 'tpu'"),
        (["demo", "--lr", "0"], "--lr: 0.0 must be > 0"),
        (["launch"], "invalid choice: 'launch'"),
        ([], "the following arguments are required: command"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_tp_larger_than_the_world_is_a_clear_error_not_a_hang(capsys):
    assert cli.main(["demo", "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "policyworker demo: error:" in err and "torchrun --nproc-per-node 2" in err


def test_cuda_device_without_cuda_is_a_clear_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error path is for CPU-only machines")
    assert cli.main(["demo", "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device is visible; use --device cpu" in capsys.readouterr().err


def test_committed_config_reference_equals_the_generated_text():
    committed = (ROOT / "docs" / "config-reference.md").read_text()
    assert committed == docs_gen.render(), "run: python -m policyworker._dev.docs_gen"


def test_config_reference_lists_every_field_of_every_section():
    import attrs

    from policyworker import config

    text = docs_gen.render()
    for cls in (
        config.PolicyConfig,
        config.DTensorConfig,
        config.LoRAConfig,
        config.SequencePackingConfig,
        config.GenerationConfig,
        config.SchedulerEntry,
    ):
        assert f"## {cls.__name__}" in text
        for field in attrs.fields(cls):
            assert f"| `{field.name}` |" in text, (cls.__name__, field.name)
    assert "| `model_name` | str | **required** |" in text
    assert "`policy.megatron_cfg`" in text


def test_rows_in_the_agreed_schema_get_a_ratio_when_missing():
    rows = bench_table.normalize_rows(
        "refit",
        {
            "rows": [
                {"metric": "refit 1.5B", "ours": 2.0, "baseline": 4.0, "limit": 1.0, "unit": "s"},
                {"metric": "given", "ours": 3.0, "baseline": 1.0, "ratio": 2.5, "unit": "x"},
            ]
        },
    )
    assert [r.ratio for r in rows] == [0.5, 2.5]
    assert rows[0].limit == 1.0 and rows[0].unit == "s" and rows[0].bench == "refit"
    assert bench_table.normalize_rows("x", [{"metric": "m", "ours": 1}])[0].ours == 1.0


def test_a_result_without_rows_becomes_one_row_per_numeric_leaf():
    generic = bench_table.normalize_rows("other", {"a": {"b": 1.5}, "c": "text", "d": True})
    assert [(r.metric, r.ours) for r in generic] == [("a.b", 1.5)]
    named = bench_table.normalize_rows(
        "x", {"rows": [{"metric": "m", "ours": 1.0, "baseline_name": "plain HF"}]}
    )
    assert named[0].baseline_name == "plain HF"


def test_table_has_one_line_per_row_under_a_header():
    rows = [
        bench_table.BenchRow(bench="b", metric="m", ours=1234.5, baseline=None, unit="ms"),
        bench_table.BenchRow(bench="b", metric="n", ours=2e-5, baseline=1e-5, ratio=2.0),
    ]
    lines = bench_table.format_table(rows).splitlines()
    assert lines[0].split() == [
        "bench",
        "metric",
        "ours",
        "baseline",
        "limit",
        "ratio",
        "unit",
        "check",
    ]
    assert len(lines) == 4 and "1,234" in lines[2] and "2.00x" in lines[3]


def _judged(target, ours, baseline=None):
    row = bench_table.normalize_rows(
        "b", [{"metric": "m", "ours": ours, "baseline": baseline, "limit": target}]
    )[0]
    return bench_table.row_verdict(row)


def test_text_targets_get_a_pass_or_fail_and_cpu_only_figures_are_n_a():
    assert _judged("<= 1.05x", 7.03, 1.0) == "fail" and _judged("<= 1.05x", 1.0, 1.0) == "pass"
    assert _judged(">= baseline", 2.0, 1.0) == "pass" and _judged(">= baseline", 1.0, 2.0) == "fail"
    assert _judged("<= 25% of baseline", 1.0, 5.0) == "pass"
    assert _judged("<= 25% of baseline", 2.0, 5.0) == "fail"
    assert _judged(">= 0.4", 0.42) == "pass" and _judged("fits comfortably (< 139)", 140) == "fail"
    assert _judged("<= 25% of baseline", 0.0, 0.0) == "n/a"  # no ratio without a baseline
    assert _judged("peak GiB", 1.0) is None and _judged(None, 1.0) is None
    rows = [
        bench_table.BenchRow(
            bench="t", metric="packed MFU", ours=0.0001, baseline=0.0, target=">= 0.4", ratio=0.0002
        ),
        bench_table.BenchRow(bench="c", metric="load", ours=math.nan, unit="GB/s"),
        bench_table.BenchRow(
            bench="f",
            metric="train step ms",
            ours=7.03,
            baseline=1.0,
            ratio=7.03,
            target="<= 1.05x",
        ),
    ]
    cpu = bench_table.format_table(rows, cpu=True).splitlines()
    assert cpu[2].split()[-6:] == ["n/a", "n/a", ">=", "0.4", "n/a", "n/a"]
    assert "nan" not in "\n".join(cpu) and "0.00x" not in "\n".join(cpu)
    assert cpu[3].split()[2] == "n/a" and cpu[4].rstrip().endswith("FAIL")
    gpu = bench_table.format_table(rows).splitlines()
    assert gpu[2].rstrip().endswith("fail".upper()) and "0.00x" in gpu[2]


def test_runner_runs_each_script_writes_summary_and_reports_failures(tmp_path, capsys):
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "good.py").write_text(
        textwrap.dedent("""
        import argparse, json
        assert __name__ == "__main__"
        p = argparse.ArgumentParser(); p.add_argument("--small", action="store_true")
        p.add_argument("--json")
        a = p.parse_args()
        json.dump({"rows": [{"metric": "m", "ours": 2.0, "baseline": 1.0, "unit": "s",
                             "small": a.small}]}, open(a.json, "w"))
    """)
    )
    (bench / "bad.py").write_text("if __name__ == '__main__':\n    raise SystemExit(3)\n")
    (bench / "_helper.py").write_text("raise SystemExit('helpers are not benchmarks')\n")
    (bench / "common.py").write_text("raise SystemExit('no __main__ guard: a helper')\n")
    rows, summary = bench_runner.run_benchmarks(bench, small=True, timeout_s=60)
    assert [(r.bench, r.ratio) for r in rows] == [("good", 2.0)]
    assert summary["benchmarks"]["bad"]["returncode"] == 3
    assert summary["benchmarks"]["good"]["returncode"] == 0 and summary["small"] is True
    on_disk = json.loads((bench / "results" / "summary.json").read_text())
    assert on_disk["benchmarks"]["good"]["rows"][0]["ours"] == 2.0
    assert bench_runner.main(["--bench-dir", str(bench), "--only", "good"]) == 0
    assert bench_runner.main(["--bench-dir", str(bench), "--only", "bad"]) == 1
    out = capsys.readouterr().out
    assert "good" in out and "2.00x" in out
    with pytest.raises(SystemExit):
        bench_runner.main(["--bench-dir", str(bench), "--only", "nope"])
    assert "--only nope: no such benchmark" in capsys.readouterr().err


def test_python_dash_m_entry_point_exists(monkeypatch):
    import runpy

    monkeypatch.setattr(sys, "argv", ["policyworker", "--help"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("policyworker", run_name="__main__")
    assert exc.value.code == 0


def test_a_results_folder_is_reported_with_its_settings_and_verdicts_without_running(
    tmp_path, capsys
):
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    refit = {
        "device": "NVIDIA H200",
        "args": {"shapes": ["qwen2.5-7b"], "repeats": 3, "out": "/root/out/refit.json"},
        "rows": [  # a numeric limit beside a text target: the target is what gets judged
            {"metric": "one-pass ms", "ours": 13.3, "limit": 13.7, "target": "<= 15 (issue 17)"}
        ],
    }
    lora = {  # the schema with its settings
        "device": "NVIDIA H200",
        "settings": {"batch": 4},
        "rows": [
            {"metric": "LoRA tok/s", "ours": 100.0, "baseline": 100.0, "target": ">= 1.1x"},
            {"metric": "LoRA fp32 tok/s", "ours": 80.0, "baseline": 100.0},
            {"metric": "refit ms", "ours": 3.0, "baseline": 2.0, "unit": "ms"},
        ],
    }
    (gpu / "refit.json").write_text(json.dumps(refit))
    (gpu / "lora.json").write_text(json.dumps(lora))
    (gpu / "summary.json").write_text("{not read")  # the runner's own file is skipped
    results = bench_table.read_results(gpu)
    assert not results.cpu
    assert [r.bench for r in results.rows] == ["lora"] * 3 + ["refit"]
    assert results.rows[-1].target == "<= 15 (issue 17)" and results.rows[-1].limit == 13.7
    assert bench_table.row_verdict(results.rows[-1]) == "pass"
    assert results.settings == {
        "lora": "NVIDIA H200: batch=4",
        "refit": "NVIDIA H200: shapes=['qwen2.5-7b'], repeats=3",  # where it wrote: left out
    }
    assert bench_runner.main(["--report", str(gpu)]) == 1  # LoRA at 1.0x misses its 1.1x
    out = capsys.readouterr().out
    assert "refit: NVIDIA H200: shapes=['qwen2.5-7b']" in out
    assert "targets: 1 pass, 1 FAIL\n" in out and "CPU results" not in out
    lora["rows"][0]["ours"] = 120.0
    (gpu / "lora.json").write_text(json.dumps(lora))
    assert bench_runner.main(["--report", str(gpu)]) == 0
    assert "targets: 2 pass, 0 FAIL\n" in capsys.readouterr().out

    cpu = tmp_path / "cpu"
    cpu.mkdir()
    (cpu / "refit.json").write_text(json.dumps({**refit, "device": "cpu"}))
    assert bench_table.read_results(cpu).cpu
    bench_runner.main(["--report", str(cpu)])
    assert "(CPU results: the targets are set for full-size GPU runs)" in capsys.readouterr().out
    (cpu / "broken.json").write_text("{")
    with pytest.raises(SystemExit):
        bench_runner.main(["--report", str(cpu)])
    assert "broken.json is not JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_runner.main(["--report", str(tmp_path / "none")])
    assert "no <name>.json results there" in capsys.readouterr().err
