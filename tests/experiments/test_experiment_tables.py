"""``python -m experiments.pixel`` and ``python -m experiments.sd3``: init, collect (from records written
as the runner writes them), figures, into a temporary results folder."""

from __future__ import annotations

import copy
import json
import math

import pandas as pd
import pytest
from helpers import ROOT

from experiments import pixel, sd3
from specsamp.runner import compose, run_config


@pytest.fixture(scope="module")
def record():
    """A real record (a tiny GMM run), to be relabelled as the jobs of a sweep."""
    rec, _ = run_config(compose(["model.dim=4", "n_samples=4", "steps=5", "progress=false"]))
    rec["status"] = "ok"
    return rec


def write_jobs(root, record, jobs):
    for i, fields in enumerate(jobs):
        rec = copy.deepcopy(record)
        for k, v in fields.items():
            rec[k] = v
            rec["config"][k] = v if k in ("K", "L", "eps") else rec["config"].get(k)
        d = root / f"job{i}"
        d.mkdir(parents=True)
        (d / "result.json").write_text(json.dumps(rec))
    return root


def test_pixel_init_collect_figures(tmp_path, record, monkeypatch, capsys):
    monkeypatch.setattr(pixel, "OUT", tmp_path / "pixel")
    assert pixel.main(["init"]) == 0
    assert {p.name for p in (tmp_path / "pixel").iterdir()} == {"fig4_cifar10.csv", "fig4_ffhq.csv", "fid.csv"}
    fid = pd.read_csv(tmp_path / "pixel" / "fid.csv")
    assert fid["fid"].isna().all() and fid["fid_paper"].tolist() == [1.79, 1.822, 1.824, 2.39, 2.88, 2.86]
    speed = {"mean": 2.4, "std": 0.3, "sem": 0.03}
    sweep = write_jobs(
        tmp_path / "sweep",
        record,
        [
            {"sampler": "dgrs", "eps": 0.3, "K": 2, "L": 3, "speedup": speed, "model": "edm-cifar10-32x32-cond-vp"},
            {"sampler": "rmc", "eps": 0.1, "K": 4, "L": 4, "speedup": {**speed, "mean": 2.2}},
            {"sampler": "dgrs", "eps": 0.3, "K": 9, "L": 9, "speedup": speed},  # not a cell of Figure 4: ignored
        ],
    )
    assert pixel.main(["collect", "--dataset", "cifar10", "--sweep", str(sweep)]) == 0
    assert "2 of 24 cells filled" in capsys.readouterr().out
    t = pd.read_csv(tmp_path / "pixel" / "fig4_cifar10.csv")
    cell = t[(t["sampler"] == "dgrs") & (t["eps"] == 0.3) & (t["K"] == 2) & (t["L"] == 3)].iloc[0]
    assert cell["speedup_mean"] == 2.4 and cell["n_samples"] == 4 and cell["paper_range"] == "2.2–2.6x"
    assert pixel.main(["figures"]) == 0 and (tmp_path / "pixel" / "fig4_speedup_vs_budget.png").is_file()
    with pytest.raises(SystemExit) as e:  # no such sweep: says which experiment to run
        pixel.main(["collect", "--dataset", "ffhq", "--sweep", str(tmp_path / "none")])
    assert e.value.code == 2 and "+experiment=fig4_ffhq" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pixel.main(["fid", "--sampler", "dgrs"])  # --images missing: argparse usage error


def test_sd3_init_collect_figures(tmp_path, record, monkeypatch, capsys):
    monkeypatch.setattr(sd3, "OUT", tmp_path / "sd3")
    monkeypatch.setattr(sd3, "TABLE", tmp_path / "sd3" / "fig5_table1.csv")
    assert sd3.main(["init"]) == 0
    rows = []
    for K, sp, clip in ((6, 1.18, 31.2), (3, 1.11, 31.0)):
        rec = {
            "sampler": "dgrs",
            "K": K,
            "L": 2,
            "speedup": {"mean": sp, "std": 0.1, "sem": 0.01},
            "clip_score": clip,
            "metrics": {"clip_score": clip, "clip_score_sem": 0.4, "clip_scores": [clip] * 4},
        }
        rows.append(rec)
    rows.append(
        {
            "sampler": "standard",
            "K": 1,
            "L": 1,
            "speedup": {"mean": 1.0, "std": 0.0, "sem": 0.0},
            "metrics": {"clip_score": 31.1, "clip_score_sem": 0.5},
        }
    )
    sweep = write_jobs(tmp_path / "sweep", record, rows)
    assert sd3.main(["collect", "--sweep", str(sweep)]) == 0
    t = pd.read_csv(tmp_path / "sd3" / "fig5_table1.csv")
    six = t[(t["sampler"] == "dgrs") & (t["K"] == 6)].iloc[0]
    assert six["speedup_mean"] == 1.18 and six["clip_mean"] == 31.2 and six["clip_sem"] == 0.4
    assert six["paper_speedup"] == "1.18x (peak)"
    std = t[t["sampler"] == "standard"].iloc[0]
    assert std["clip_mean"] == 31.1 and math.isclose(std["clip_sem"], 0.5)
    assert sd3.main(["figures"]) == 0 and (tmp_path / "sd3" / "fig5_speedup_vs_K.png").is_file()
    capsys.readouterr()


def test_gmm_table_printed_claims_equal_the_results_readme_rows():
    """``python -m experiments.gmm table`` (from the committed grid.csv) and the section 5.1 table of
    ``results/README.md`` say the same: for every quantity in both, the documented value starts with the
    printed one (the table may add the 1,000-trajectory reruns after it)."""

    from experiments import gmm
    from experiments.common import read_csv

    def rows(text):
        out = {}
        for line in text.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 3 and cells[0] not in ("quantity", "---"):
                out[cells[0]] = cells[2]
        return out

    printed = rows(gmm.paper_table(read_csv(gmm.GRID_CSV)))
    text = (ROOT / "results" / "README.md").read_text()
    section = text.split("### Section 5.1, number by number", 1)[1].split("\n#", 1)[0]
    readme = rows(section)
    common = set(printed) & set(readme)
    assert {"D-GRS first beats RMC from", "RMC plateau over the grid"} <= common
    for q in common:
        assert readme[q].startswith(printed[q]), (q, printed[q], readme[q])


def test_make_sweep_local_comment_gives_the_cells_speedups():
    """The Makefile's comment on SWEEP_ARGS gives the four cells' speedups (seed 0, 16 trajectories) to the
    two decimals it prints; they are deterministic counts, so they must equal a run of those cells."""
    import re

    from specsamp.runner import compose, run_config

    make = (ROOT / "Makefile").read_text()
    said = [float(x) for x in re.search(r"about ([\d., ]+)x\)", make).group(1).split(", ")]
    args = re.search(r"^SWEEP_ARGS \?= model.dim=(\d+) steps=(\d+) n_samples=(\d+) K=1,2 L=2,3$", make, re.M).groups()
    got = []
    for K in (1, 2):
        for L in (2, 3):
            rec, _ = run_config(
                compose(
                    [
                        f"model.dim={args[0]}",
                        f"steps={args[1]}",
                        f"n_samples={args[2]}",
                        f"K={K}",
                        f"L={L}",
                        "progress=false",
                    ]
                )
            )
            got.append(round(rec["speedup"]["mean"], 2))
    assert got == said
