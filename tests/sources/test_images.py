"""ImageFolder: layout, pixel fidelity, seeded crops for any workers, faults, missing extra."""

import os
import sys

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed._sources.resample import random_resized, resize_into

pytest.importorskip("simplejpeg")
Image = pytest.importorskip("PIL.Image")


def _photo(h, w, seed, gray=False):
    """A smooth image with some detail, so JPEG keeps it recognisable."""
    y, x = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(seed)
    chans = [(127 + 100 * np.sin(x / (5 + 3 * c) + y / (7 + c) + seed)).astype(np.uint8)
             for c in range(3)]
    img = np.stack(chans, -1) + rng.integers(0, 20, (h, w, 3), dtype=np.uint8)
    return img[..., 0] if gray else img


def make_folder(root, sizes=((48, 64), (64, 48), (40, 40), (80, 90))):
    """Three classes; JPEGs of several shapes, a grayscale JPEG and a PNG."""
    k = 0
    for c in ("cat", "ant", "bee"):
        (root / c).mkdir(parents=True)
        for j, (h, w) in enumerate(sizes):
            Image.fromarray(_photo(h, w, k)).save(root / c / f"{j}.jpg", quality=90)
            k += 1
        Image.fromarray(_photo(50, 50, k, gray=True)).save(root / c / "g.jpeg")
        Image.fromarray(_photo(30, 44, k + 1)).save(root / c / "p.png")
        (root / c / "notes.txt").write_text("not an image")
        k += 2
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("imgs"))


def test_layout_follows_torchvision(folder):
    ds = gpufeed.sources.ImageFolder(folder, size=32)
    assert ds.classes == ["ant", "bee", "cat"] and ds.class_to_idx["cat"] == 2
    assert len(ds) == 18 and list(ds.targets) == [0] * 6 + [1] * 6 + [2] * 6
    assert ds.files[0] == "ant/0.jpg" and isinstance(ds.files, gpufeed.sources.PackedList)
    img, label = ds[7]
    assert img.dtype == torch.uint8 and img.shape == (3, 32, 32) and label == 1


def test_accurate_decode_equals_pillow(folder):
    """No crop, no resize: the tensor is Pillow's decode of the file, pixel for pixel."""
    for name, hw in (("0.jpg", (48, 64)), ("g.jpeg", (50, 50)), ("p.png", (30, 44))):
        ds = gpufeed.sources.ImageFolder(folder, size=hw, crop="center", center_fraction=1.0,
                                         flip=False)
        i = [str(f) for f in ds.files].index(f"bee/{name}")
        want = np.asarray(Image.open(folder / "bee" / name).convert("RGB"))
        got = ds[i][0].permute(1, 2, 0).numpy()
        np.testing.assert_array_equal(got, want)
    fast = gpufeed.sources.ImageFolder(folder, size=(48, 64), crop="center", center_fraction=1.0,
                                       fast=True)
    diff = np.abs(fast[6][0].permute(1, 2, 0).numpy().astype(int)
                  - np.asarray(Image.open(folder / "bee/0.jpg")).astype(int))
    assert 0 < diff.mean() < 8  # fast DCT/upsampling: close (a few levels), not exact


def test_reduced_dct_scale_is_close_to_full_decode(tmp_path):
    (tmp_path / "a").mkdir()
    Image.fromarray(_photo(256, 256, 1)).save(tmp_path / "a" / "x.jpg", quality=95)
    kw = dict(size=64, crop="center", center_fraction=1.0)
    scaled = gpufeed.sources.ImageFolder(tmp_path, **kw)[0][0].int()
    full = gpufeed.sources.ImageFolder(tmp_path, dct_scale=False, **kw)[0][0].int()
    assert not torch.equal(scaled, full)  # the 1/4 scale decode was taken
    assert (scaled - full).abs().float().mean() < 4


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_resized_crop_is_pillows_resize_of_the_cut_region(memory_format):
    """The region is cut, then resized (bilinear, antialiased) into the batch's memory in
    either layout (through HWC memory for planes): the same pixels as ``interpolate`` makes,
    and Pillow's bilinear resize of the same cut to within rounding, shrinking and enlarging
    (see NOTE [ Resampling ])."""

    def _crop_resize(img, top, left, h, w, size, flip):
        dst = torch.full((1, 3, *size), 7, dtype=torch.uint8).to(memory_format=memory_format)
        resize_into(dst[0].permute(1, 2, 0).numpy(), img[top:top + h, left:left + w], flip)
        assert dst.is_contiguous(memory_format=memory_format)
        return dst[0].permute(1, 2, 0).numpy()

    img = _photo(375, 500, 3)
    for top, left, h, w in ((10, 20, 350, 400), (100, 50, 120, 150), (0, 0, 375, 500)):
        got = _crop_resize(img, top, left, h, w, (224, 200), 0.0)
        chw = torch.from_numpy(np.ascontiguousarray(img[top:top + h, left:left + w]))
        ref = torch.nn.functional.interpolate(chw.permute(2, 0, 1)[None], size=(224, 200),
                                              mode="bilinear", antialias=True)
        np.testing.assert_array_equal(got, ref[0].permute(1, 2, 0).numpy())
        cut = Image.fromarray(np.ascontiguousarray(img[top:top + h, left:left + w]))
        want = np.asarray(cut.resize((200, 224), Image.Resampling.BILINEAR))
        diff = np.abs(got.astype(int) - want.astype(int))
        assert got.shape == (224, 200, 3) and diff.mean() < 0.5 and diff.max() <= 3, (
            (top, left, h, w), diff.mean(), diff.max())
        flipped = _crop_resize(img, top, left, h, w, (224, 200), 1.0)
        np.testing.assert_array_equal(flipped, got[:, ::-1])
    window = _crop_resize(img, 7, 9, 224, 200, (224, 200), 0.0)  # exact size: a plain window
    np.testing.assert_array_equal(window, img[7:231, 9:209])
    np.testing.assert_array_equal(_crop_resize(img, 7, 9, 224, 200, (224, 200), 1.0),
                                  img[7:231, 9:209][:, ::-1])


@pytest.mark.parametrize("kw", [dict(size=(32, 256), crop="center"),
                                dict(size=(16, 256), crop="random", scale=None),
                                dict(size=24, crop="center", center_fraction=0.25)])
def test_a_very_thin_image_still_gives_an_image(tmp_path, kw):
    """A region under half a pixel across (a 300x2 image cut to a wide output) is one pixel
    wide, resized, never an empty cut."""
    (tmp_path / "a").mkdir()
    Image.fromarray(np.full((300, 2, 3), 128, np.uint8)).save(tmp_path / "a" / "thin.png")
    img = gpufeed.sources.ImageFolder(tmp_path, **kw)[0][0]
    hw = kw["size"] if isinstance(kw["size"], tuple) else (kw["size"],) * 2
    assert img.shape == (3, *hw) and int(img.min()) == int(img.max()) == 128


def test_random_resized_parameters_respect_scale_and_ratio():
    rng = np.random.default_rng(0)
    for _ in range(300):
        top, left, h, w = random_resized(375, 500, (0.2, 0.6), (0.75, 1.33), rng)
        assert 0 <= top <= 375 - h and 0 <= left <= 500 - w
        assert 0.2 - 0.01 <= h * w / (375 * 500) <= 0.6 + 0.01
        assert 0.74 <= w / h <= 1.34


@pytest.mark.parametrize("crop", ["random", "center"])
def test_batches_same_for_any_workers_and_batch_size(folder, crop):
    ds = gpufeed.sources.ImageFolder(folder, size=24, crop=crop, scale=(0.3, 1.0))
    runs = {}
    for nw, wt in ((0, "process"), (2, "process"), (2, "thread")):
        loader = gpufeed.DataLoader(ds, batch_size=4, shuffle=True, seed=5, num_workers=nw,
                                    worker_type=wt)
        runs[(nw, wt)] = [[t.clone() for t in b] for b in loader]
    first = runs[(0, "process")]
    for got in runs.values():
        assert all(torch.equal(a, b) for x, y in zip(first, got, strict=True)
                   for a, b in zip(x, y, strict=True))
    # per-sample seeds: the same images whatever the batch size; the next epoch differs
    loader = gpufeed.DataLoader(ds, batch_size=6, shuffle=True, seed=5)
    assert torch.equal(torch.cat([b[0] for b in loader]), torch.cat([b[0] for b in first]))
    second = torch.cat([b[0] for b in loader])
    if crop == "random":
        assert not torch.equal(second, torch.cat([b[0] for b in first]))


def test_equals_the_stock_loader(folder):
    ds = gpufeed.sources.ImageFolder(folder, size=(20, 28), crop="center")
    want = list(torch.utils.data.DataLoader(ds, batch_size=5))
    for nw in (0, 2):
        got = list(gpufeed.DataLoader(ds, batch_size=5, num_workers=nw))
        assert len(got) == len(want)
        for w, g in zip(want, got, strict=True):
            assert type(g) is list and torch.equal(w[0], g[0]) and torch.equal(w[1], g[1])
    got = list(gpufeed.DataLoader(ds, batch_size=5, collate_fn=lambda b: b))
    assert [s[1] for b in got for s in b] == list(ds.targets)


@pytest.mark.parametrize("kw", [dict(crop="random", scale=(0.3, 1.0)),
                                dict(crop="random", scale=None, size=(30, 20)),
                                dict(crop="center", center_fraction=0.5)])
def test_channels_last_batches_equal_channels_first(folder, kw):
    """``memory_format=torch.channels_last``: the same values in every crop (resized, a plain
    window, a center cut; flips and the Pillow path included) under gpufeed's process and
    thread workers and the stock loader; gpufeed's batches keep the HWC memory."""
    kw = {"size": (24, 28), **kw}
    planes = gpufeed.sources.ImageFolder(folder, **kw)
    last = gpufeed.sources.ImageFolder(folder, memory_format=torch.channels_last, **kw)
    assert "channels_last" in repr(last) and "channels_last" not in repr(planes)
    want = [b[0] for b in gpufeed.DataLoader(planes, batch_size=5, shuffle=True, seed=3)]
    assert all(b.is_contiguous() for b in want)
    for nw, wt in ((0, "process"), (2, "process"), (2, "thread")):
        got = [b[0] for b in gpufeed.DataLoader(last, batch_size=5, shuffle=True, seed=3,
                                                num_workers=nw, worker_type=wt)]
        assert all(g.is_contiguous(memory_format=torch.channels_last) and g.shape[1] == 3
                   for g in got), (nw, wt)
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True)), (nw, wt)
    stock = [b[0] for b in torch.utils.data.DataLoader(last, batch_size=5, num_workers=1)]
    assert [b.shape for b in stock] == [b.shape for b in want]
    if kw["crop"] == "center":  # unseeded random crops differ from call to call
        ref = torch.utils.data.DataLoader(planes, batch_size=5)
        assert all(torch.equal(a, b[0]) for a, b in zip(stock, ref, strict=True))


def test_flip_mirrors(folder):
    ds = gpufeed.sources.ImageFolder(folder, size=(48, 64), crop="random", scale=None, flip=True)
    plain = gpufeed.sources.ImageFolder(folder, size=(48, 64), crop="center", center_fraction=1.0)
    flips = [torch.equal(ds.gpufeed_batch([0], seed=s, epoch=0, alloc=None)[0][0],
                         plain[0][0].flip(-1)) for s in range(12)]
    assert any(flips) and not all(flips)


def _corrupt(root):
    bad = root / "bee" / "9_bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0" + b"garbage" * 10)
    return bad


def test_corrupt_file_is_named_and_can_be_skipped(tmp_path):
    root = make_folder(tmp_path, sizes=((40, 40),))
    bad = _corrupt(root)
    ds = gpufeed.sources.ImageFolder(root, size=16)
    for nw in (0, 2):
        loader = gpufeed.DataLoader(ds, batch_size=4, num_workers=nw)
        with pytest.raises(Exception, match=str(bad.name)) as info:
            list(loader)
        assert "on_error='skip'" in str(info.value)
    ds = gpufeed.sources.ImageFolder(root, size=16, on_error="skip")
    batches = list(gpufeed.DataLoader(ds, batch_size=4, num_workers=2))
    labels = torch.cat([b[1] for b in batches])
    k = [str(f) for f in ds.files].index("bee/9_bad.jpg")
    assert labels[k] == -1 and (labels >= 0).sum() == len(ds) - 1
    assert torch.cat([b[0] for b in batches])[k].sum() == 0


def _decoders():
    from gpufeed._sources.jpeg import find_turbojpeg

    return ["simplejpeg"] + (["turbojpeg"] if find_turbojpeg()[0] else [])


@pytest.mark.parametrize("decoder", _decoders())
def test_a_damaged_jpeg_is_refused_whatever_the_crop(tmp_path, decoder):
    """A file cut short (no end marker, or 90% of its bytes) is refused in every epoch, as
    the stock path refuses it, not only when the random crop reaches its missing end."""
    (tmp_path / "a").mkdir()
    buf = tmp_path / "whole.jpg"
    Image.fromarray(_photo(120, 160, 5)).save(buf, quality=90)
    data = buf.read_bytes()
    buf.unlink()
    (tmp_path / "a" / "cut.jpg").write_bytes(data[:int(len(data) * 0.9)])
    (tmp_path / "a" / "noeoi.jpg").write_bytes(data[:-2])
    ds = gpufeed.sources.ImageFolder(tmp_path, size=32, decoder=decoder, on_error="skip")
    labels = [ds.gpufeed_batch([0, 1], seed=0, epoch=e, alloc=None)[1] for e in range(24)]
    assert torch.stack(labels).eq(-1).all()


@pytest.mark.parametrize("decoder", _decoders())
def test_a_jpeg_the_codec_refuses_gets_the_codecs_crop_from_pillow(tmp_path, decoder):
    """CMYK goes to Pillow, as the stock path converts it; the crop and flip are the ones
    drawn for the sample, the same as a PNG of the same pixels gets."""
    (tmp_path / "jpg" / "a").mkdir(parents=True)
    (tmp_path / "png" / "a").mkdir(parents=True)
    cmyk = tmp_path / "jpg" / "a" / "c.jpg"
    Image.fromarray(_photo(90, 120, 3)).convert("CMYK").save(cmyk, quality=95)
    with Image.open(cmyk) as im:
        im.convert("RGB").save(tmp_path / "png" / "a" / "c.png")
    for crop in ("random", "center"):
        jpg, png = [gpufeed.sources.ImageFolder(tmp_path / kind, size=40, crop=crop,
                                                scale=(0.2, 0.6), decoder=decoder, flip=True)
                    for kind in ("jpg", "png")]
        for seed in range(6):  # sample 0 of each: the same seed, so the same draws
            a, b = [ds.gpufeed_samples([0], seed=seed, epoch=0)[0][0] for ds in (jpg, png)]
            assert torch.equal(a, b), (crop, seed)


def test_a_subsampling_simplejpeg_cannot_name_goes_to_pillow(tmp_path):
    turbojpeg = pytest.importorskip("turbojpeg")  # the wheel writes 4:4:1, Pillow cannot
    (tmp_path / "a").mkdir()
    img = _photo(64, 64, 2)
    (tmp_path / "a" / "x.jpg").write_bytes(
        turbojpeg.compress(img, 90, turbojpeg.SAMP.Y441, pixelformat=turbojpeg.PF.RGB))
    ds = gpufeed.sources.ImageFolder(tmp_path, size=(64, 64), crop="center", center_fraction=1.0,
                                     decoder="simplejpeg", flip=False)
    got, label = ds[0]
    with Image.open(tmp_path / "a" / "x.jpg") as im:
        want = torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1)
    assert label == 0 and torch.equal(got, want)


def test_bad_arguments_and_paths(tmp_path, folder):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        gpufeed.sources.ImageFolder(tmp_path / "nowhere", size=8)
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes a"):
        gpufeed.sources.ImageFolder(tmp_path / "empty", size=8)
    with pytest.raises(ValueError, match="crop='middle'"):
        gpufeed.sources.ImageFolder(folder, size=8, crop="middle")
    with pytest.raises(ValueError, match="size=0"):
        gpufeed.sources.ImageFolder(folder, size=0)
    with pytest.raises(ValueError, match="size=True"):
        gpufeed.sources.ImageFolder(folder, size=True)
    assert gpufeed.sources.ImageFolder(folder, size=np.int64(8))[0][0].shape == (3, 8, 8)
    (folder / "ant" / "9_text.jpg").write_text("not an image at all")
    try:
        ds = gpufeed.sources.ImageFolder(folder, size=8)
        k = [str(f) for f in ds.files].index("ant/9_text.jpg")
        with pytest.raises(ValueError, match=r"9_text\.jpg.*Pillow cannot identify it as an image"):
            ds[k]
    finally:
        (folder / "ant" / "9_text.jpg").unlink()
    with pytest.raises(ValueError, match=r"memory_format=torch.preserve_format.*channels_last"):
        gpufeed.sources.ImageFolder(folder, size=8, memory_format=torch.preserve_format)


def test_missing_extra_names_it(folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "simplejpeg", None)
    with pytest.raises(ImportError, match=r"pip install 'gpufeed\[image\]'"):
        gpufeed.sources.ImageFolder(folder, size=8)


def test_unreadable_file_named(tmp_path):
    root = make_folder(tmp_path, sizes=((40, 40),))
    ds = gpufeed.sources.ImageFolder(root, size=16)
    (root / "ant" / "0.jpg").unlink()
    with pytest.raises(ValueError, match=r"ant/0\.jpg"):
        ds[0]


# -- torchvision's ImageFolder, next to this one ----------------------------------------------
# torchvision cannot be imported here (its PyPI wheel is a CUDA build: with a CPU torch it fails
# with "operator torchvision::nms does not exist"), so its documented behaviour is written out
# below: the layout walk of DatasetFolder.make_dataset and, for the pixels, the tensor path of
# Resize(256) + CenterCrop(224) (torch's antialiased bilinear interpolate on uint8).


def _torchvision_samples(root, exts=(".jpg", ".jpeg", ".png")):
    root = str(root)
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    out = []
    for k, c in enumerate(classes):
        for dirpath, _, names in sorted(os.walk(os.path.join(root, c), followlinks=True)):
            out += [(os.path.join(dirpath, n), k) for n in sorted(names)
                    if n.lower().endswith(exts)]
    return classes, out


def test_samples_imgs_and_targets_are_torchvisions(folder):
    ds = gpufeed.sources.ImageFolder(folder, size=16, crop="center")
    classes, want = _torchvision_samples(folder)
    assert ds.classes == classes and ds.class_to_idx == {c: k for k, c in enumerate(classes)}
    assert list(ds.samples) == want and ds.samples == want and ds.imgs == want
    assert ds.samples[7] == want[7] and ds.samples[-1] == want[-1]
    assert ds.samples[2:4] == want[2:4] and len(ds.samples) == len(want) == len(ds)
    assert list(ds.targets) == [t for _, t in want]
    # assigning samples (torchvision users subset or relabel this way) re-packs them
    ds.samples = [s for s in want if s[0].endswith(".png")][::-1]
    assert len(ds) == 3 and list(ds.targets) == [2, 1, 0]
    assert ds.samples[0] == want[-1] and isinstance(ds.files, gpufeed.sources.PackedList)
    whole = gpufeed.sources.ImageFolder(folder, size=16, crop="center")
    assert torch.equal(ds[0][0], whole[len(whole) - 1][0]) and ds[0][1] == 2  # the last png
    with pytest.raises(TypeError, match="pairs"):
        ds.samples = ["a.jpg"]


def test_empty_class_and_valid_file_rules_are_torchvisions(tmp_path):
    root = make_folder(tmp_path / "r", sizes=((40, 40),))
    (root / "dog").mkdir()
    (root / "dog" / "x.txt").write_text("no image")
    with pytest.raises(FileNotFoundError) as info:
        gpufeed.sources.ImageFolder(root, size=8)
    assert str(info.value) == ("Found no valid file for the classes dog. Supported extensions "
                               "are: .jpg, .jpeg, .png, .ppm, .bmp, .pgm, .tif, .tiff, .webp")
    ds = gpufeed.sources.ImageFolder(root, size=8, allow_empty=True)
    assert ds.classes == ["ant", "bee", "cat", "dog"] and len(ds) == 9
    only = gpufeed.sources.ImageFolder(root, size=8, is_valid_file=lambda p: p.endswith(("0.jpg",
                                                                                         "x.txt")))
    assert [os.path.basename(p) for p, _ in only.samples] == ["0.jpg"] * 3 + ["x.txt"]
    with pytest.raises(ValueError, match="Both extensions and is_valid_file cannot be None or "
                                         "not None at the same time"):
        gpufeed.sources.ImageFolder(root, size=8, extensions=(".jpg",), is_valid_file=bool)
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="Couldn't find any class folder in"):
        gpufeed.sources.ImageFolder(tmp_path / "flat", size=8)


def _torchvision_center(img, resize=256, crop=224):
    """torchvision's Resize(resize) + CenterCrop(crop) on a uint8 HWC image, tensor path."""
    h, w = img.shape[:2]
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = resize, int(resize * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    t = torch.from_numpy(np.array(img)).permute(2, 0, 1)[None]
    t = torch.nn.functional.interpolate(t, size=(new_h, new_w), mode="bilinear",
                                        align_corners=False, antialias=True)[0]
    top, left = round((new_h - crop) / 2.0), round((new_w - crop) / 2.0)  # int(round(...))
    return t[:, top:top + crop, left:left + crop]


@pytest.mark.parametrize("kind", ["noisy", "photo"])
def test_center_crop_is_torchvisions_resize_256_center_crop_224(tmp_path, kind):
    """Issue 19: crop="center" was up to 34 levels off Resize(256) + CenterCrop(224) on noisy
    images (8-9 on photo-like ones); now within two levels, JPEG and PNG, both orientations."""
    rng = np.random.default_rng(5)
    (tmp_path / "a").mkdir()
    shapes = ((375, 500), (500, 333), (300, 451), (256, 256))
    for k, (h, w) in enumerate(shapes):
        img = (rng.integers(0, 256, (h, w, 3), dtype=np.uint8) if kind == "noisy"
               else _photo(h, w, k))
        Image.fromarray(img).save(tmp_path / "a" / f"{k}.jpg", quality=92)
        Image.fromarray(img).save(tmp_path / "a" / f"{k}.png")
    ds = gpufeed.sources.ImageFolder(tmp_path, size=224, crop="center")
    assert not ds.flip
    for i in range(len(ds)):
        path = ds.path(i)
        want = _torchvision_center(np.asarray(Image.open(path).convert("RGB")))
        got = ds[i][0]
        assert got.shape == want.shape == (3, 224, 224)
        diff = (got.int() - want.int()).abs()
        assert diff.max() <= 2, (path, int(diff.max()), float(diff.float().mean()))


def test_center_crop_of_a_large_image_and_dct_scale(tmp_path):
    """A large image is decoded at a DCT scale by default (documented: a few levels off);
    dct_scale=False gives torchvision's pixels."""
    (tmp_path / "a").mkdir()
    img = _photo(768, 1100, 9)
    Image.fromarray(img).save(tmp_path / "a" / "big.jpg", quality=95)
    want = _torchvision_center(np.asarray(Image.open(tmp_path / "a" / "big.jpg")))
    exact = gpufeed.sources.ImageFolder(tmp_path, size=224, crop="center", dct_scale=False)[0][0]
    assert (exact.int() - want.int()).abs().max() <= 2
    scaled = gpufeed.sources.ImageFolder(tmp_path, size=224, crop="center")[0][0]
    diff = (scaled.int() - want.int()).abs().float()
    assert 0 < diff.mean() < 3


def test_target_transform_is_refused_naming_what_to_use(folder):
    for name in ("target_transform", "loader"):
        with pytest.raises(TypeError, match=rf"takes no {name}=.*device_transform=gpufeed"
                                            r"\.Normalize.*torchvision\.datasets\.ImageFolder"):
            gpufeed.sources.ImageFolder(folder, size=8, **{name: lambda x: x})


def test_repr_is_torchvisions_layout(folder):
    text = repr(gpufeed.sources.ImageFolder(folder, size=24, crop="center"))
    lines = text.splitlines()
    assert lines[:3] == ["Dataset ImageFolder", "    Number of datapoints: 18",
                         f"    Root location: {folder}"]
    assert "Classes: 3" in text and "crop='center' (Resize(27) + CenterCrop)" in text
    assert "Decoder: " in text
