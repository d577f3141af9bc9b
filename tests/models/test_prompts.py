"""Prompt sets: the COCO draw (deterministic, without replacement, seed-dependent), demo prompts, pairing."""

import json

import numpy as np
import pytest

from specsamp.models.sd3.prompts import (
    coco_prompt_records,
    coco_prompts,
    demo_prompts,
    image_plan,
    load_prompts,
    read_prompt_file,
)


@pytest.fixture
def captions_json(tmp_path):
    """A fake captions_val2014.json: 30 images with 5 captions each, annotations shuffled."""
    rng = np.random.default_rng(123)
    anns = [
        {"image_id": 1000 + i, "id": 10 * i + j, "caption": f"  image {i} caption {j}\n"}
        for i in range(30)
        for j in range(5)
    ]
    order = rng.permutation(len(anns))
    path = tmp_path / "captions_val2014.json"
    path.write_text(json.dumps({"images": [], "annotations": [anns[k] for k in order]}))
    return path, anns


def test_coco_draw_is_deterministic_distinct_and_seed_dependent(captions_json, tmp_path):
    path, anns = captions_json
    a = coco_prompt_records(path, n=12, seed=0)
    assert a == coco_prompt_records(path, n=12, seed=0)
    images = [r["image_id"] for r in a]
    assert len(set(images)) == 12  # without replacement, one caption per image
    valid = {(x["image_id"], x["id"]): " ".join(x["caption"].split()) for x in anns}
    for r in a:
        assert valid[(r["image_id"], r["annotation_id"])] == r["caption"]
        assert r["caption"] == r["caption"].strip()
    b = coco_prompt_records(path, n=12, seed=1)
    assert [r["image_id"] for r in b] != images
    # prefix-stable: a smaller draw is the start of a larger one with the same seed
    assert coco_prompt_records(path, n=5, seed=0) == a[:5]
    # independent of the order of the annotations in the file
    other = tmp_path / "sorted.json"
    other.write_text(json.dumps({"annotations": anns}))
    assert coco_prompt_records(other, n=12, seed=0) == a
    assert coco_prompts(path, n=12, seed=0) == [r["caption"] for r in a]
    # all images drawable, none twice
    full = coco_prompt_records(path, n=30, seed=3)
    assert sorted(r["image_id"] for r in full) == list(range(1000, 1030))


def test_coco_draw_spreads_over_images_and_captions(captions_json):
    """Over 200 seeds each image is drawn about 12/30 of the time and each caption slot is used."""
    path, _ = captions_json
    counts = np.zeros(30)
    slots = set()
    for s in range(200):
        for r in coco_prompt_records(path, n=12, seed=s):
            counts[r["image_id"] - 1000] += 1
            slots.add(r["annotation_id"] % 10)
    expected = 200 * 12 / 30  # 80 per image; binomial sd ~ 6.9
    assert np.all(np.abs(counts - expected) < 6 * np.sqrt(200 * 0.4 * 0.6))
    assert slots == set(range(5))


def test_coco_errors(captions_json, tmp_path):
    path, _ = captions_json
    with pytest.raises(ValueError, match="n=31"):
        coco_prompts(path, n=31)
    with pytest.raises(ValueError, match="n=0"):
        coco_prompts(path, n=0)
    with pytest.raises(FileNotFoundError, match="captions_val2014"):
        coco_prompts(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"images": []}))
    with pytest.raises(ValueError, match="not a COCO captions file"):
        coco_prompts(bad)


def test_demo_prompts_packaged():
    all_prompts = demo_prompts()
    assert len(all_prompts) == 20
    assert all(p and not p.startswith("#") for p in all_prompts)
    assert demo_prompts(3) == all_prompts[:3]
    with pytest.raises(ValueError, match="n=21"):
        demo_prompts(21)


def test_load_prompts_sources(captions_json, tmp_path):
    path, _ = captions_json
    assert load_prompts("coco", 4, 7, captions_json=path) == coco_prompts(path, 4, 7)
    assert load_prompts("demo", 2) == demo_prompts(2)
    f = tmp_path / "p.txt"
    f.write_text("# comment\n\nfirst prompt\n second   prompt \n")
    assert read_prompt_file(f) == ["first prompt", "second prompt"]
    assert load_prompts("file", 1, path=f) == ["first prompt"]
    assert load_prompts(prompts=["a", "b"]) == ["a", "b"]
    with pytest.raises(ValueError, match="prompts.source='nope'"):
        load_prompts("nope")
    # the messages name the run's keys (model.prompts.*), which run.py prints as they are
    with pytest.raises(ValueError, match=r"model\.prompts\.captions_json .* or choose model\.prompts\.source=demo"):
        load_prompts("coco")
    with pytest.raises(ValueError, match=r"model\.prompts\.path .* is required for model\.prompts\.source='file'"):
        load_prompts("file")


def test_image_plan_pairs():
    plan = image_plan(["a", "b", "c"], images_per_prompt=2)
    assert plan.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert plan.noise_id.tolist() == [0, 1, 2, 3, 4, 5]
    assert len(plan) == 6
    one = image_plan(["a", "b"])
    assert one.prompt_index.tolist() == one.noise_id.tolist() == [0, 1]
    with pytest.raises(ValueError, match="images_per_prompt=0"):
        image_plan(["a"], 0)
