"""uint8 conversion, grids and index-named files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from specsamp.images import load_images, make_grid, save_grid, save_images, to_uint8


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
    with pytest.raises(FileNotFoundError, match="no images at"):
        load_images(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no index-named PNG"):
        load_images(tmp_path / "empty")
    save_images(_samples(1, hw=4), tmp_path / "mixed")
    save_images(_samples(1, hw=6), tmp_path / "mixed", start_index=1)
    with pytest.raises(ValueError, match="different shapes"):
        load_images(tmp_path / "mixed")
    gray = np.zeros((1, 3, 3, 1), dtype=np.uint8)
    save_images(gray, tmp_path / "gray")
    assert load_images(tmp_path / "gray").shape == (1, 3, 3, 1)


def test_load_images_by_indices(tmp_path):
    u = to_uint8(_samples(4))
    save_images(u, tmp_path / "png", start_index=10)
    np.testing.assert_array_equal(load_images(tmp_path / "png", indices=[12, 10]), u[[2, 0]])
    with pytest.raises(FileNotFoundError, match="1 images are missing.*000014.png"):
        load_images(tmp_path / "png", indices=[13, 14])
