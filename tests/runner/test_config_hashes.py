"""The config hash of existing configs is fixed: records in ``multirun/`` and ``results/`` resume and skip
only while ``config_hash`` (and the ``unused`` keys it hashes at their default) gives the same value.
The hashes below were computed before the tree rules declared the keys they read; every sampler, tree
rule, draft and model appears, with keys a rule does not read set away from their default."""

import pytest

from specsamp.runner.config import compose
from specsamp.runner.loop import record_hash

HASHES = [
    ("sampler=standard", "62a8856514ad5292"),
    ("sampler=standard draft=x0 K=3 L=2", "62a8856514ad5292"),
    ("sampler=standard match=verification widths=[2,2] budget=9", "62a8856514ad5292"),
    ("sampler=standard prefetch=parent warmup=step0 evaluate_leaves=false execution=tree refine=1", "62a8856514ad5292"),
    ("sampler=rmc", "9e2795c0bc938b50"),
    ("sampler=rmc draft=x0 K=3 L=2", "054326ad9645fb57"),
    ("sampler=rmc match=verification widths=[2,2] budget=9", "cc4c6725cd2cf227"),
    ("sampler=rmc prefetch=parent warmup=step0 evaluate_leaves=false execution=tree refine=1", "9bbcb440f0ea0930"),
    ("sampler=dgrs", "dd3aca344e5fa5ea"),
    ("sampler=dgrs draft=x0 K=3 L=2", "9d6509d9c6dcae5f"),
    ("sampler=dgrs match=verification widths=[2,2] budget=9", "dd3aca344e5fa5ea"),
    ("sampler=dgrs prefetch=parent warmup=step0 evaluate_leaves=false execution=tree refine=1", "031181dc02a245d2"),
    ("sampler=markmax", "d9fd6121d5540b7e"),
    ("sampler=markmax draft=x0 K=3 L=2", "34188415eaf8acc3"),
    ("sampler=markmax match=verification widths=[2,2] budget=9", "d9fd6121d5540b7e"),
    ("sampler=markmax prefetch=parent warmup=step0 evaluate_leaves=false execution=tree refine=1", "a53f9db4bec32601"),
    ("sampler=dgrs tree=uniform widths=[3,2]", "dd3aca344e5fa5ea"),
    (
        "sampler=dgrs tree=uniform widths=[3,2] budget=12 K=4 L=5 max_depth=3 max_width=4 "
        "delta_profile=[0.5,0.6] match=verification",
        "96e6108f69d66b38",
    ),
    ("sampler=markmax tree=uniform widths=[2,2] delta_profile=gmm_x0", "d9fd6121d5540b7e"),
    ("sampler=standard tree=uniform widths=[2,2]", "62a8856514ad5292"),
    ("sampler=dgrs tree=widths widths=[3,2]", "ace76526096c0c3f"),
    (
        "sampler=dgrs tree=widths widths=[3,2] budget=12 K=4 L=5 max_depth=3 max_width=4 "
        "delta_profile=[0.5,0.6] match=verification",
        "ace76526096c0c3f",
    ),
    ("sampler=markmax tree=widths widths=[2,2] delta_profile=gmm_x0", "4fee88375b4eb43c"),
    ("sampler=standard tree=widths widths=[2,2]", "62a8856514ad5292"),
    ("sampler=dgrs tree=optimal widths=[3,2]", "1d277034756c170c"),
    (
        "sampler=dgrs tree=optimal widths=[3,2] budget=12 K=4 L=5 max_depth=3 max_width=4 "
        "delta_profile=[0.5,0.6] match=verification",
        "37217d8709c63033",
    ),
    ("sampler=markmax tree=optimal widths=[2,2] delta_profile=gmm_x0", "53f6889fb6f25230"),
    ("sampler=standard tree=optimal widths=[2,2]", "62a8856514ad5292"),
    ("sampler=dgrs tree=optimal_per_step widths=[3,2]", "00a8b35e27bc1de7"),
    (
        "sampler=dgrs tree=optimal_per_step widths=[3,2] budget=12 K=4 L=5 max_depth=3 max_width=4 "
        "delta_profile=[0.5,0.6] match=verification",
        "8a8ce53fcc3f955a",
    ),
    ("sampler=markmax tree=optimal_per_step widths=[2,2] delta_profile=gmm_x0", "af5d633dbe69921a"),
    ("sampler=standard tree=optimal_per_step widths=[2,2]", "62a8856514ad5292"),
    ("sampler=dgrs draft=drift", "b2dd23615aec4eb3"),
    ("sampler=rmc draft=drift match=verification", "58e97e1616d5a4ea"),
    ("sampler=dgrs draft=velocity", "dd3aca344e5fa5ea"),
    ("sampler=rmc draft=velocity match=verification", "cc4c6725cd2cf227"),
    ("sampler=dgrs draft=x0", "6b5b15218159a608"),
    ("sampler=rmc draft=x0 match=verification", "6d8615856228f6df"),
    ("sampler=dgrs draft=x0_affine", "6d882450940ab27b"),
    ("sampler=rmc draft=x0_affine match=verification", "6675cca7bfa4e95e"),
    ("sampler=dgrs draft=x0_extrap", "8cb9025915edbaaa"),
    ("sampler=rmc draft=x0_extrap match=verification", "2a5b7ebf4c1cfed4"),
    ("sampler=dgrs draft=x0_extrap_gated", "c5d6a70b9f56a128"),
    ("sampler=rmc draft=x0_extrap_gated match=verification", "8e5a7de07033a503"),
    ("model=gmm", "dd3aca344e5fa5ea"),
    ("model=gmm sampler=standard K=7", "62a8856514ad5292"),
    ("model=gmm sampler=rmc tree=uniform K=3", "40e9dcbe13d92b30"),
    ("model=gmm sampler=dgrs tree=optimal budget=10 K=5", "bbb67e7dbc19f621"),
    ("model=digits", "a3be60cbf177f803"),
    ("model=digits sampler=standard K=7", "97d2378444a704b7"),
    ("model=digits sampler=rmc tree=uniform K=3", "eb9f99c44aad57f1"),
    ("model=digits sampler=dgrs tree=optimal budget=10 K=5", "eb04c12ede8b3624"),
    ("model=cifar10", "0b3c21341d04a4ec"),
    ("model=cifar10 sampler=standard K=7", "16baf66999de94d8"),
    ("model=cifar10 sampler=rmc tree=uniform K=3", "fe714296d1be5a0d"),
    ("model=cifar10 sampler=dgrs tree=optimal budget=10 K=5", "3759d6ef7810ef4b"),
    ("model=ffhq", "53fbb2f47a95c106"),
    ("model=ffhq sampler=standard K=7", "db5d20ae34916db7"),
    ("model=ffhq sampler=rmc tree=uniform K=3", "0600d8e9349a060d"),
    ("model=ffhq sampler=dgrs tree=optimal budget=10 K=5", "c49df6d713ba7f60"),
    ("model=patches32", "7bc54b49500ec06b"),
    ("model=patches32 sampler=standard K=7", "4b1164e1c2a9ea60"),
    ("model=patches32 sampler=rmc tree=uniform K=3", "60edc98b69f10c15"),
    ("model=patches32 sampler=dgrs tree=optimal budget=10 K=5", "bb48f8fc28e4c98f"),
    ("model=sd3", "25e0de868094e49f"),
    ("model=sd3 sampler=standard K=7", "8b553b8afd01c41b"),
    ("model=sd3 sampler=rmc tree=uniform K=3", "9a9ebd4e8922a0e0"),
    ("model=sd3 sampler=dgrs tree=optimal budget=10 K=5", "31f623c6ab1d8865"),
]


@pytest.mark.parametrize("overrides, expected", HASHES, ids=[o for o, _ in HASHES])
def test_config_hash_is_unchanged(overrides, expected):
    assert record_hash(compose(overrides.split()))[2] == expected
