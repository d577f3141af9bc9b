"""Strict types and values: every bad input of the list below exits 2 with one paragraph naming the key,
its value and what is valid, no traceback, and leaves an existing record (same output directory, same
config otherwise) byte for byte unchanged. Also: keys the sampler does not read are recorded as unused
and hashed at their default; a typo'd key names the closest valid key."""

import shutil

import pytest
from helpers import TINY, run, run_inprocess

from specsamp.errors import ConfigError
from specsamp.runner.config import closest_key, compose, load_config
from specsamp.runner.explain import valid_keys
from specsamp.runner.loop import record_hash, run_config


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """An output directory holding the record of a good TINY run (so a bad value must beat the skip)."""
    d = tmp_path_factory.mktemp("done")
    run(TINY, d)
    return d


BAD = [
    (["save_samples=maybe"], ["save_samples=maybe", "not a valid bool"]),
    (["skip_existing=maybe"], ["skip_existing=maybe", "not a valid bool"]),
    (["threads=0"], ["threads=0", ">= 1 or null"]),  # null: torch's own default
    (["progress=maybe"], ["progress='maybe'", "auto"]),
    (["seed=-1"], ["seed=-1", "2**59"]),
    (["K=abc"], ["K=abc", "Integer", "must be an integer >= 1"]),
    (["model.guidance=2"], ["model.guidance=2", "is not a key of GMMConfig"]),  # an sd3 key on the gmm target
    ([f"seed={2**70}"], [f"seed={2**70}", "2**59"]),
    (["device=mps"], ["device='mps'", "cpu, cuda"]),
    (["model.dtype=foo"], ["model.dtype='foo'", "float32"]),
    (["eps=nan"], ["eps=nan", "finite"]),
    (["Kk=3"], ["Kk=3", "did you mean K?"]),
    (["+Kk=3"], ["Kk=3", "did you mean K?"]),
    (["sampler.nme=x"], ["sampler.nme", "did you mean sampler.name?"]),
    (["model.dtpye=float32"], ["model.dtpye", "did you mean model.dtype?"]),
    (["evaluate_leaves=sure"], ["evaluate_leaves=sure"]),
    (["tree=optimal", "max_width=0"], ["max_width=0"]),
    (["compile=maybe"], ["compile=maybe", "not a valid bool"]),
    (["compile=true", "execution=path"], ["compile=true", "execution=path", "execution=tree"]),
    (["compile=true", "execution=tree", "refine=1"], ["compile=true", "refine=1", "refine=0"]),
    # a model key of the wrong type says what its field takes
    (["model.dim=abc"], ["model.dim=abc", "Integer; must be an integer."]),
    (["model.components=1.5"], ["model.components=1.5", "must be an integer"]),
    # documented values only: null is not one of auto/true/false, a number is not a bool
    (["check_contract=null"], ["check_contract=null is invalid", "auto", "true, false"]),
    (["progress=null"], ["progress=null is invalid"]),
    (["compile=2"], ["compile=2 is invalid", "true or false"]),
    # upper bounds: threads (2**31 overflowed torch, 100000 crashed OpenMP), L (the nominal budget K^L)
    ([f"threads={2**31}"], [f"threads={2**31} is invalid", "at most 1024"]),
    (["threads=100000"], ["threads=100000 is invalid", "at most 1024"]),
    ([f"L={2**63}"], [f"L={2**63} is invalid", "at most 100000"]),
    (["execution=tree", "refine=100000"], ["refine=100000 is invalid with steps=8", "refine=6 or less"]),
]


def _check_refusal(code, stdout, stderr, needles, out, before):
    assert code == 2, (stdout, stderr)
    err = stderr.strip()
    assert err.startswith("error: ") and "\n" not in err, err  # one paragraph
    for needle in needles:
        assert needle in err, (needle, err)
    assert "Traceback" not in stderr + stdout
    assert (out / "result.json").read_bytes() == before


@pytest.mark.parametrize("args,needles", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_value_exits_2_and_keeps_the_record(done, tmp_path, monkeypatch, args, needles):
    out = tmp_path / "out"
    shutil.copytree(done, out)
    before = (out / "result.json").read_bytes()
    _check_refusal(*run_inprocess([*TINY, *args], out, monkeypatch), needles, out, before)


@pytest.mark.parametrize("args,needles", [BAD[3], BAD[9]], ids=["progress=maybe", "Kk=3"])
def test_bad_value_exits_2_from_the_command_line(done, tmp_path, args, needles):
    out = tmp_path / "out"
    shutil.copytree(done, out)
    before = (out / "result.json").read_bytes()
    p = run([*TINY, *args], out, check=False)
    _check_refusal(p.returncode, p.stdout, p.stderr, needles, out, before)


def _cfg(*overrides):
    return compose([*TINY, *overrides])


def _hash(*overrides):
    return record_hash(_cfg(*overrides))[2]


def test_unused_keys_are_recorded_and_hashed_at_their_default(capsys):
    assert _hash("sampler=standard") == _hash("sampler=standard", "draft=x0", "K=5")
    rec, _ = run_config(_cfg("sampler=standard", "draft=x0", "K=5"))
    assert rec["unused"] == {"draft": "x0", "K": 5} and rec["config"]["draft"] == "x0"
    assert "unused" in capsys.readouterr().err
    assert "unused" not in run_config(_cfg("sampler=standard"))[0]
    # keys a tree rule does read still change the hash; `match` (the rmc arm's) does not
    assert _hash("draft=x0") != _hash()
    assert _hash("match=verification") == _hash()
    assert _hash("sampler=rmc", "match=verification") != _hash("sampler=rmc")


def test_seed_range_and_closest_key():
    load_config(_cfg(f"seed={2**59 - 1}"))
    with pytest.raises(ConfigError, match=r"seed=576460752303423488 .*\[0, 2\*\*59\)"):
        load_config(_cfg(f"seed={2**59}"))
    assert closest_key("n_sample", valid_keys("n_sample")) == "n_samples"
    assert closest_key("zzzzzz", valid_keys("zzzzzz")) is None
    assert closest_key("model.dtpye", valid_keys("model.dtpye")) == "model.dtype"


def test_a_plain_dict_is_checked_like_a_composed_config():
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(_cfg(), resolve=True)
    assert load_config(plain)[1] == load_config(_cfg())[1]
    with pytest.raises(ConfigError, match="Kk=3 is not a key.*did you mean K"):
        load_config({**plain, "Kk": 3})
    with pytest.raises(ConfigError, match="model.dtpye.*did you mean model.dtype"):
        load_config({**plain, "model": {**plain["model"], "dtpye": "float32"}})


def test_a_key_of_another_model_is_not_suggested_back():
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(_cfg(), resolve=True)
    with pytest.raises(ConfigError) as err:
        load_config({**plain, "model": {**plain["model"], "guidance": 2.0}})
    msg = str(err.value)
    assert (
        "not a key of GMMConfig" in msg
        and "did you mean" not in msg
        and "model.guidance" not in msg.split("Valid keys")[1]
    )


def test_threads_default_is_one():
    assert _cfg().threads == 1


def test_compile_is_hashed_only_when_true(monkeypatch):
    # compile=false is every existing record's round: left out of the record and its hash (the pinned hashes hold);
    # compile=true changes rounding, so its records hash apart; the standard sampler does not read it
    assert _hash("compile=false", "execution=tree") == _hash("execution=tree")
    assert "compile" not in load_config(_cfg("execution=tree"))[1]
    assert _hash("compile=true", "execution=tree") != _hash("execution=tree")
    assert _hash("sampler=standard", "compile=true") == _hash("sampler=standard")


def test_compile_without_a_compiler_exits_2(done, tmp_path, monkeypatch):
    # the inductor check is cheap: no C compiler on PATH (PATH emptied) refuses compile=true up front
    out = tmp_path / "out"
    shutil.copytree(done, out)
    before = (out / "result.json").read_bytes()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CXX", raising=False)
    got = run_inprocess([*TINY, "compile=true", "execution=tree"], out, monkeypatch)
    _check_refusal(*got, ["compile=true", "C/C++ compiler", "compile=false"], out, before)
