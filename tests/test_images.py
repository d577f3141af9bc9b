"""uint8 conversion, grids, index-named files and atomic shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from specsamp.images import (
    MissingShardsError,
    list_shards,
    load_images,
    make_grid,
    merge_shards,
    save_grid,
    save_images,
    save_shard,
    shard_name,
    to_uint8,
)


def _samples(n, seed=0, hw=4):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, hw, hw, generator=g) * 2.4 - 1.2  # some values outside [-1, 1]


def test_to_uint8_matches_edm_convention():
    x = torch.tensor([-1.5, -1.0, -0.5, 0.0, 0.5, 0.999, 1.0, 2.0]).reshape(1, 1, 2, 4).expand(1, 3, 2, 4)
    u = to_uint8(x)
    assert u.dtype == np.uint8 and u.shape == (1, 2, 4, 3)
    # NVlabs/edm generate.py: (x * 127.5 + 128).clip(0, 255).to(torch.uint8), channels last
    ref = (x * 127.5 + 128).clip(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    np.testing.assert_array_equal(u, ref)
    assert u[0, 0, :, 0].tolist() == [0, 0, 64, 128] and u[0, 1, :, 0].tolist() == [191, 255, 255, 255]
    assert to_uint8(x[0]).shape == (2, 4, 3)
    with pytest.raises(ValueError, match="channel axis"):
        to_uint8(torch.zeros(2, 5, 4, 4))


def test_grid_and_index_named_pngs(tmp_path):
    x = _samples(5)
    u = to_uint8(x)
    grid = make_grid(u, nrow=3, pad=1)
    assert grid.shape == (2 * 5 - 1, 3 * 5 - 1, 3)
    np.testing.assert_array_equal(grid[5:9, 5:9], u[4])  # row 1, column 1
    assert (grid[:, 4] == 0).all()
    p = save_grid(x, tmp_path / "grid.png", nrow=3)
    assert np.asarray(Image.open(p)).shape == (8, 12, 3)
    files = save_images(x, tmp_path / "png", start_index=998)
    assert [f.name for f in files] == ["000998.png", "000999.png", "001000.png", "001001.png", "001002.png"]
    np.testing.assert_array_equal(np.asarray(Image.open(files[2])), u[2])
    np.testing.assert_array_equal(load_images(tmp_path / "png"), u)


def test_shards_atomic_merge_and_missing(tmp_path):
    x = _samples(10, seed=1)
    u = to_uint8(x)
    d = tmp_path / "shards"
    assert save_shard(d, 0, x[:4]).name == shard_name(0, 4) == "shard_0000000_00004.npz"
    save_shard(d, 8, u[8:])
    (d / ".shard_0000004_00004.npz.abc.tmp").write_bytes(b"partial")  # a killed writer's leftover
    assert [(s, c) for s, c, _ in list_shards(d)] == [(0, 4), (8, 2)]
    with pytest.raises(MissingShardsError) as e:
        merge_shards(d, 10)
    assert e.value.missing == [(4, 7)]
    assert "indices 4-7" in str(e.value) and "shard_0000004_00004.npz" in str(e.value)
    save_shard(d, 4, x[4:8])
    save_shard(d, 4, x[4:8])  # a rerun overwrites the same shard atomically
    merged = merge_shards(d, 10, out=tmp_path / "all.npz")
    np.testing.assert_array_equal(merged, u)
    np.testing.assert_array_equal(load_images(tmp_path / "all.npz"), u)
    np.testing.assert_array_equal(load_images(d), u)
    with pytest.raises(MissingShardsError, match="10-11"):
        merge_shards(d, 12)
    assert not [p for p in d.iterdir() if p.name.endswith(".tmp") and "abc" not in p.name]


def test_shard_errors(tmp_path):
    with pytest.raises(ValueError, match="start_index=-1"):
        save_shard(tmp_path, -1, _samples(1))
    with pytest.raises(ValueError, match="empty"):
        save_shard(tmp_path, 0, np.zeros((0, 4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match="total=0"):
        merge_shards(tmp_path, 0)
    save_shard(tmp_path / "a", 0, _samples(2, seed=2))
    save_shard(tmp_path / "a", 1, _samples(2, seed=3))  # overlaps index 1 with other pixels
    with pytest.raises(ValueError, match="overlaps"):
        merge_shards(tmp_path / "a", 3)


def test_as_pixels_is_the_one_convention_at_the_metric_boundary():
    """Floats in [-1, 1] (a target's decode output) or uint8 pixels in either layout; anything else is
    refused instead of being scored as something it is not."""
    from specsamp.images import as_pixels

    x = _samples(3, hw=6).clamp(-1, 1)
    u = to_uint8(x)
    np.testing.assert_array_equal(as_pixels(x), u)
    np.testing.assert_array_equal(as_pixels(x.double().numpy()), u)
    np.testing.assert_array_equal(as_pixels(u), u)  # channels last
    np.testing.assert_array_equal(as_pixels(torch.from_numpy(u).permute(0, 3, 1, 2)), u)  # channels first
    np.testing.assert_array_equal(as_pixels(u[0]), u[:1])
    # the inverse map of the convention reproduces the pixels exactly
    np.testing.assert_array_equal(as_pixels(torch.from_numpy(u).permute(0, 3, 1, 2).float() / 127.5 - 1), u)
    with pytest.raises(ValueError, match=r"span \[0, 255\].*\[-1, 1\]"):
        as_pixels(torch.from_numpy(u).permute(0, 3, 1, 2).float())  # pixels as floats
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        as_pixels(_samples(2))  # raw samples outside [-1, 1], not passed through decode
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        as_pixels(torch.full((1, 3, 2, 2), float("nan")))
    with pytest.raises(ValueError, match="dtype int64"):
        as_pixels(np.zeros((1, 2, 2, 3), dtype=np.int64))


def test_image_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="expected \\[N, C, H, W\\]"):
        to_uint8(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="convert with to_uint8"):
        make_grid(np.zeros((1, 2, 2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="expected uint8 \\[N, H, W, C\\]"):
        make_grid(np.zeros((1, 2, 2, 5), dtype=np.uint8))
    assert make_grid(np.zeros((2, 2, 3), dtype=np.uint8)).shape == (2, 2, 3)  # one image, no batch axis
    with pytest.raises(ValueError, match="nrow=0"):
        make_grid(np.zeros((2, 2, 2, 3), dtype=np.uint8), nrow=0)
    with pytest.raises(ValueError, match="indices has 1 entries for 2 images"):
        save_images(_samples(2), tmp_path / "x", indices=[0])
    assert list_shards(tmp_path / "nothing") == []
    with pytest.raises(FileNotFoundError, match="no images at"):
        load_images(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no shards or index-named PNG"):
        load_images(tmp_path / "empty")
    save_images(_samples(1, hw=4), tmp_path / "mixed")
    save_images(_samples(1, hw=6), tmp_path / "mixed", start_index=1)
    with pytest.raises(ValueError, match="different shapes"):
        load_images(tmp_path / "mixed")
    gray = np.zeros((1, 3, 3, 1), dtype=np.uint8)
    save_images(gray, tmp_path / "gray")
    assert load_images(tmp_path / "gray").shape == (1, 3, 3, 1)


def test_merge_shards_checks_names_and_shapes(tmp_path):
    d = tmp_path / "s"
    save_shard(d, 0, _samples(2))
    save_shard(d, 5, _samples(1))  # beyond total=2: ignored
    assert merge_shards(d, 2).shape == (2, 4, 4, 3)
    (d / shard_name(2, 3)).write_bytes((d / shard_name(0, 2)).read_bytes())  # contents disagree with the name
    with pytest.raises(ValueError, match="its name says 3 from 2"):
        merge_shards(d, 5)
    e = tmp_path / "t"
    save_shard(e, 0, _samples(1, hw=4))
    save_shard(e, 1, _samples(1, hw=6))
    with pytest.raises(ValueError, match="has images of shape"):
        merge_shards(e, 2)


def test_load_images_by_indices(tmp_path):
    u = to_uint8(_samples(4))
    save_images(u, tmp_path / "png", start_index=10)
    np.testing.assert_array_equal(load_images(tmp_path / "png", indices=[12, 10]), u[[2, 0]])
    with pytest.raises(FileNotFoundError, match="1 images are missing.*000014.png"):
        load_images(tmp_path / "png", indices=[13, 14])
