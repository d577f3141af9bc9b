"""``run.py sampler=auto``: the choice in the record, the cache a second run reuses, the keys it does not read, and its
refusals (exit 2, before sampling)."""

from __future__ import annotations

import json

from helpers import run_inprocess

TINY = ["model.dim=8", "steps=6", "n_samples=4", "progress=false"]


def _record(out) -> dict:
    return json.loads((out / "result.json").read_text())


def test_auto_records_its_choice_and_a_second_run_reuses_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSAMP_CACHE_DIR", str(tmp_path / "cache"))
    code, stdout, stderr = run_inprocess([*TINY, "sampler=auto", "K=5"], tmp_path / "a", monkeypatch)
    assert code == 0, stderr
    rec = _record(tmp_path / "a")
    a = rec["auto"]
    assert rec["sampler"] == "auto" and a["choice"] in ("loop", "rmc", "dgrs")
    assert a["curve_source"] == "measured" and a["profile_source"] == "pilot"
    assert a["realised_seconds"] > 0 and a["predicted_seconds"] > 0 and a["call_cost"]["rows"]
    assert "sampler=auto chose=" in stdout and "K=5" in stderr  # K is not read: noted, hashed at its default
    assert rec["unused"] == {"K": 5}
    assert (tmp_path / "cache" / "call_costs.json").is_file() and (tmp_path / "cache" / "profiles.json").is_file()
    code, _, stderr = run_inprocess([*TINY, "sampler=auto", "seed=1"], tmp_path / "b", monkeypatch)
    assert code == 0, stderr
    b = _record(tmp_path / "b")["auto"]
    assert b["curve_source"] == "cached" and b["profile_source"] == "cached" and b["pilot"] is None


def test_auto_with_a_given_profile_and_the_tree_it_chose(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSAMP_CACHE_DIR", str(tmp_path / "cache"))
    code, _, stderr = run_inprocess([*TINY, "sampler=auto", "delta_profile=[0.05,0.1]"], tmp_path / "a", monkeypatch)
    assert code == 0, stderr
    rec = _record(tmp_path / "a")
    assert rec["auto"]["profile_source"] == "given" and rec["auto"]["pilot"] is None
    if rec["auto"]["choice"] != "loop":
        assert rec["tree"].startswith("auto: ") and len(rec["trees_by_root"]) == 4  # roots 1 .. T - 2


def test_a_bad_profile_exits_2_before_sampling(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSAMP_CACHE_DIR", str(tmp_path / "cache"))
    code, _, stderr = run_inprocess([*TINY, "sampler=auto", "delta_profile=[[0.1],[0.2]]"], tmp_path / "a", monkeypatch)
    assert code == 2 and "delta_profile" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "a" / "result.json").exists()
