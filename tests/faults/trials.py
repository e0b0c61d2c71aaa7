"""Count failures of fault scenarios over many trials (the closing notes' before/after tables).

``python -m tests.faults.trials ROOT NAME:TRIALS [NAME:TRIALS ...]`` runs each scenario of
``scenarios.py`` with the policyworker found under ROOT (a checkout: this tree, or one of the
code before the fixes with this folder copied in) until TRIALS trials are accounted for. A
process killed by its fault (SIGBUS, a libzmq abort) or hung past 120 s counts as one failed
trial and is started again for the rest. Prints one JSON line per scenario: trials, failures,
signals seen, and one example failure. Refit files go to private folders (see ``conftest.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile


def count(root: str, name: str, trials: int, *args: str, timeout_s: float = 120.0) -> dict:
    done, failures, signals, example = 0, 0, [], ""
    while done < trials:
        shm = tempfile.mkdtemp(prefix="pwt-", dir="/dev/shm")
        tmp = tempfile.mkdtemp(prefix="pwt-", dir="/tmp")
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": root,
            "TMPDIR": tmp,
            "POLICYWORKER_SHM_DIR": shm,
        }
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "tests.faults.scenarios", name, str(trials - done), *args],
                cwd=root,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, out, err = "hang", exc.stdout or "", f"timed out after {timeout_s:g} s"
            out = out.decode() if isinstance(out, bytes) else out
        finally:
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)
        results = [json.loads(line[2:]) for line in out.splitlines() if line.startswith("@@{")]
        by_trial: dict[int, bool] = {}
        for r in results:  # a trial may report several checks: it fails if any does
            by_trial[r["trial"]] = by_trial.get(r["trial"], True) and r["ok"]
            if not r["ok"] and not example:
                example = r["detail"][:300]
        done += len(by_trial)
        failures += sum(not ok for ok in by_trial.values())
        if code != 0:
            signals.append(code)
            done += 1  # the trial that was running when the process died
            failures += 1
            example = example or f"process ended with {code}: {err.strip().splitlines()[-1:]}"
    return {
        "scenario": name,
        "trials": done,
        "failures": failures,
        "process_deaths": signals,
        "example": example,
    }


if __name__ == "__main__":
    root = os.path.abspath(sys.argv[1])
    for spec in sys.argv[2:]:
        name, _, rest = spec.partition(":")
        trials, *args = rest.split(":")
        print(json.dumps({"root": root, **count(root, name, int(trials), *args)}), flush=True)
