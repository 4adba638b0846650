"""The plans a run was served (issue 42): ``bagualu.served_plans()`` records, per iteration, the
plan each forward ran under, in the fields bgl-sim --plans reads; bgl-sim replays the file the
run wrote, with the run's model document, and refuses it naming the operator when it does not
match the model."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import require_libs

unmodified = pytest.importorskip("unmodified")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
STRATEGIES = {"keep", "recompute", "offload", "fp8"}


def test_a_run_writes_the_plans_it_was_served_and_bgl_sim_replays_them(tmp_path: Path) -> None:
    require_libs()
    kw = dict(width=1, seq=32, ep=False, micro_batches=4)
    capacity = unmodified.keep_all_peak("qwen3_moe", **kw) // 2
    r = unmodified.train("qwen3_moe", "bagualu", capacity=capacity, iterations=2, **kw)
    assert r["oom"] is None, r["oom"]
    served = r["served_plans"]
    assert served["format"] == "bgl-served-plans" and served["version"] == 1
    assert len(served["iterations"]) == 2  # one entry per iteration, the capture's too
    names = [o["name"] for o in r["description"]["operators"]]
    steady = served["iterations"][1]["plans"]
    assert [p["micro_batch"] for p in steady] == [0, 1, 2, 3]
    for p in steady:
        assert [o["name"] for o in p["operators"]] == names
        assert {o["strategy"] for o in p["operators"]} <= STRATEGIES
        assert p["load_factor"] > 0 and p["issue_order"], p.keys()
    # Something was mitigated at half of keep-all's peak: the replay has work to price.
    assert any(o["strategy"] != "keep" for p in steady for o in p["operators"])

    sim = Path(os.environ.get("BGL_LIB_DIR", ROOT / "build")) / "tools" / "bgl-sim" / "bgl-sim"
    if not sim.is_file():
        pytest.skip(f"{sim} is not built")
    model = tmp_path / "model.json"
    model.write_text(json.dumps(r["model_doc"]))
    plans = tmp_path / "plans.json"
    plans.write_text(json.dumps(dict(served, iterations=served["iterations"][1:])))
    argv = [str(sim), "--model", str(model), "--gpu", "host", "--capacity",
            str(r["plan_capacity"]), "--ranks", "0", "--plans", str(plans), "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)["policies"][0]
    assert result["policy"] == "plans" and result["iterations"] == 1 and result["total_s"] > 0
    # An operator the model does not have: exit 2 naming it.
    steady[0]["operators"][0]["name"] = "L7.no_such_operator"
    plans.write_text(json.dumps(dict(served, iterations=served["iterations"][1:])))
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "L7.no_such_operator" in out.stderr, out.stderr
