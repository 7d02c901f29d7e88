"""ImageShards: tar shards indexed, read at random, decoded as ImageFolder decodes."""

import gc
import gzip
import io
import os
import pickle
import tarfile
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed._sources import tarindex
from gpufeed._sources.tarindex import expand, members

pytest.importorskip("simplejpeg")
pytest.importorskip("PIL.Image")

from test_images import make_folder


def _bytes(path):
    with open(path, "rb") as f:
        return f.read()


def _add(tf, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 1_700_000_000
    tf.addfile(info, io.BytesIO(data))


def shards_of(folder, out, splits=(7, 5), fmt=tarfile.USTAR_FORMAT, prefix=""):
    """``folder``'s images in ImageFolder's order as webdataset shards: ``<key>.<ext>`` and
    ``<key>.cls`` per sample, cut into shards after ``splits`` samples."""
    ds = gpufeed.sources.ImageFolder(folder, size=8)
    out.mkdir(exist_ok=True)
    paths, start = [], 0
    for k, stop in enumerate([*np.cumsum(splits), len(ds)]):
        paths.append(str(out / f"part-{k:03d}.tar"))
        with tarfile.open(paths[-1], "w", format=fmt) as tf:
            for i in range(start, stop):
                ext = os.path.splitext(ds.files[i])[1][1:]
                key = f"{prefix}{i:05d}"
                _add(tf, f"{key}.{ext}", _bytes(ds.path(i)))
                _add(tf, f"{key}.cls", b"%d\n" % ds.targets[i])
        start = stop
    return ds, paths


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    folder = make_folder(tmp_path_factory.mktemp("imgs"))
    ds, paths = shards_of(folder, tmp_path_factory.mktemp("shards"))
    return folder, ds, paths


@pytest.mark.parametrize("kw", [dict(crop="random", scale=(0.2, 1.0)),
                                dict(crop="random", scale=None, size=(30, 20)),
                                dict(crop="center", memory_format=torch.channels_last)])
def test_batches_equal_image_folders_for_any_workers(tree, kw):
    """The same images (JPEG, grayscale JPEG, PNG) in shards give ImageFolder's batches, bit
    for bit, shuffled with one seed, under 0 workers, process and thread workers."""
    folder, _, paths = tree
    kw = {"size": 24, **kw}
    want = list(gpufeed.DataLoader(gpufeed.sources.ImageFolder(folder, **kw), batch_size=5,
                                   shuffle=True, seed=4))
    ds = gpufeed.sources.ImageShards(paths, **kw)
    assert len(ds) == 18 and ds.keys[0] == "00000"
    for nw, wt in ((0, "process"), (2, "process"), (2, "thread")):
        got = list(gpufeed.DataLoader(ds, batch_size=5, shuffle=True, seed=4, num_workers=nw,
                                      worker_type=wt))
        assert len(got) == len(want)
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w[0], g[0]) and torch.equal(w[1], g[1]), (nw, wt)


def test_index_equals_webdataset_and_tarfile(tree, tmp_path):
    """Keys, labels and image bytes as webdataset reads them, for shards written by
    webdataset's own writer, ustar with long paths (a prefix field), and the headers left to
    tarfile: GNU long names and pax (a non-ASCII path)."""
    wds = pytest.importorskip("webdataset")
    folder, ref, paths = tree
    sets = {"ustar": paths}
    with wds.ShardWriter(str(tmp_path / "w-%03d.tar"), maxcount=7) as sink:
        for i in range(len(ref)):
            ext = os.path.splitext(ref.files[i])[1][1:]
            sink.write({"__key__": f"s{i:05d}", ext: _bytes(ref.path(i)),
                        "cls": int(ref.targets[i])})
    sets["webdataset"] = sorted(str(p) for p in tmp_path.glob("w-*.tar"))
    sets["gnu"] = shards_of(folder, tmp_path / "gnu", fmt=tarfile.GNU_FORMAT,
                            prefix="d/" * 60)[1]
    sets["long-ustar"] = shards_of(folder, tmp_path / "long", prefix="dir/" * 30)[1]
    sets["pax"] = shards_of(folder, tmp_path / "pax", fmt=tarfile.PAX_FORMAT,
                            prefix="ü/" + "p/" * 60)[1]
    for kind, shard_paths in sets.items():
        ds = gpufeed.sources.ImageShards(shard_paths, size=8)
        with warnings.catch_warnings():  # webdataset leaves its shard files to the collector
            warnings.simplefilter("ignore", ResourceWarning)
            stream = list(wds.WebDataset(shard_paths, shardshuffle=False))
            gc.collect()
        assert list(ds.keys) == [s["__key__"] for s in stream], kind
        assert ds.targets.tolist() == [int(s["cls"]) for s in stream], kind
        for i, s in enumerate(stream):
            image = next(s[e] for e in ds.image if e in s)
            assert ds._read(i) == image, (kind, i)
    # the parser and tarfile agree on every member, offsets included
    for path in sets["long-ustar"] + sets["gnu"] + sets["pax"]:
        with tarfile.open(path) as tf:
            assert members(path) == [(m.name, m.offset_data, m.size) for m in tf if m.isreg()]


def test_texts_and_no_labels_collate_as_the_stock_loader(tree, tmp_path):
    """``text=`` adds each sample's caption (UTF-8 ``str``), ``label=None`` drops the label,
    and with neither a sample is its image: batches are what the stock loader collates from
    the same dataset's samples, under gpufeed's process and thread workers."""
    _, ref, _ = tree
    entries = []
    for i in range(len(ref)):
        entries += [(f"{i:03d}.jpg", _bytes(ref.path(i))) if ref.files[i].endswith("jpg")
                    else (f"{i:03d}.png", _bytes(ref.path(i))),
                    (f"{i:03d}.cls", b"%d" % ref.targets[i]),
                    (f"{i:03d}.txt", f"caption {i} \u00e9t\u00e9".encode())]
    path = _tar(tmp_path / "pairs.tar", entries)
    for label, text, kinds in (("cls", "txt", (torch.Tensor, torch.Tensor, tuple)),
                               (None, "txt", (torch.Tensor, tuple)),
                               ("cls", None, (torch.Tensor, torch.Tensor))):
        ds = gpufeed.sources.ImageShards(path, size=16, crop="center", label=label, text=text)
        assert len(ds[4]) == len(kinds)
        want = list(torch.utils.data.DataLoader(ds, batch_size=5))
        for nw, wt in ((0, "process"), (2, "process"), (2, "thread")):
            got = list(gpufeed.DataLoader(ds, batch_size=5, num_workers=nw, worker_type=wt))
            assert len(got) == len(want) == 4
            for w, g in zip(want, got, strict=True):
                assert type(g) is list and tuple(map(type, g)) == kinds, (label, text)
                for a, b in zip(w, g, strict=True):
                    assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    ds = gpufeed.sources.ImageShards(path, size=16, crop="center", label=None, text="txt")
    assert ds.texts[7] == "caption 7 \u00e9t\u00e9" and ds.targets.tolist() == [-1] * 18
    first = next(iter(gpufeed.DataLoader(ds, batch_size=5, num_workers=2)))
    assert first[1] == tuple(f"caption {i} \u00e9t\u00e9" for i in range(5))
    bare = gpufeed.sources.ImageShards(path, size=16, crop="center", label=None)
    assert isinstance(bare[0], torch.Tensor) and bare.texts is None
    batch = next(iter(gpufeed.DataLoader(bare, batch_size=4, num_workers=2)))
    assert isinstance(batch, torch.Tensor) and batch.shape == (4, 3, 16, 16)
    assert torch.equal(batch, next(iter(torch.utils.data.DataLoader(bare, batch_size=4))))
    with pytest.raises(ValueError, match=r"no 'json' text member \(it has: cls, jpg, txt\)"):
        gpufeed.sources.ImageShards(path, size=8, text="json")
    bad = _tar(tmp_path / "latin.tar", [("k.jpg", _bytes(ref.path(0))), ("k.cls", b"0"),
                                        ("k.txt", "\u00e9t\u00e9".encode("latin-1"))])
    with pytest.raises(ValueError, match=r"k\.txt is not UTF-8"):
        gpufeed.sources.ImageShards(bad, size=8, text="txt")


def test_shard_specs_folder_glob_and_brace_range(tree):
    _, _, paths = tree
    root = os.path.dirname(paths[0])
    assert expand(root) == paths
    assert expand(os.path.join(root, "part-*.tar")) == paths
    assert expand(os.path.join(root, "part-{000..002}.tar")) == paths
    assert expand(os.path.join(root, "part-{001..002}.tar")) == paths[1:]
    assert len(gpufeed.sources.ImageShards(os.path.join(root, "part-{000..002}.tar"), size=8)) == 18
    with pytest.raises(FileNotFoundError, match="no file matches"):
        expand(os.path.join(root, "nothing-*.tar"))
    with pytest.raises(FileNotFoundError, match=r"part-008\.tar.*2 of the 2 shards"):
        gpufeed.sources.ImageShards(os.path.join(root, "part-{008..009}.tar"), size=8)
    with pytest.raises(ValueError, match="range"):
        expand("part-{5..2}.tar")
    assert expand(os.path.join(root, "part-{000,002}.tar")) == [paths[0], paths[2]]
    assert expand("{a,b}-{0..1}.tar") == ["a-0.tar", "a-1.tar", "b-0.tar", "b-1.tar"]


def test_slow_reads_index_several_shards_at_once_in_order(tree, monkeypatch):
    """Headers read from memory: shards one after another, in the calling thread; once a
    shard's reads are slow (a cold cache, a network file system), the rest several at a time,
    the index in the shards' order all the same."""
    _, _, paths = tree
    many = paths * 4
    want = gpufeed.sources.ImageShards(many, size=8)
    seen = []
    real = tarindex.members

    def slow(path):
        seen.append(threading.current_thread().name)
        if len(seen) == 2:
            time.sleep(0.05)  # 50 ms for a 12-member shard: far slower than memory
        return real(path)

    monkeypatch.setattr(tarindex, "members", slow)
    # "slow" at 1 ms a member (12 ms a shard): the test's 50 ms stands out, a loaded machine's
    # ordinary read of the first shard does not
    monkeypatch.setattr(tarindex, "_SLOW_MEMBER_S", 1e-3)
    got = gpufeed.sources.ImageShards(many, size=8)
    assert seen[:2] == [threading.current_thread().name] * 2
    assert all(name.startswith("gpufeed-tar-index") for name in seen[2:]) and len(seen) == 12
    assert list(got.keys) == list(want.keys) and got.shard_of.tolist() == want.shard_of.tolist()
    assert got.targets.tolist() == want.targets.tolist()
    assert [got._read(i) for i in range(len(got))] == [want._read(i) for i in range(len(want))]


def test_resume_and_pickling_are_exact(tree):
    _, _, paths = tree
    ds = gpufeed.sources.ImageShards(paths, size=16)
    copy = pickle.loads(pickle.dumps(ds))
    assert list(copy.keys) == list(ds.keys) and torch.equal(copy[3][0], ds[3][0]) is not None
    kw = dict(batch_size=4, shuffle=True, seed=9, num_workers=2)
    whole = [b[1].tolist() for b in gpufeed.DataLoader(ds, **kw)]
    loader = gpufeed.DataLoader(ds, **kw)
    it = iter(loader)
    head = [next(it)[1].tolist() for _ in range(2)]
    state = loader.state_dict()
    del it
    resumed = gpufeed.DataLoader(copy, **kw)
    resumed.load_state_dict(state)
    assert head + [b[1].tolist() for b in resumed] == whole
    # two ranks share the samples out (disjoint, together every sample once), each decoded
    # with its own seed: the batches of the indices the rank's sampler gives
    kw = dict(batch_size=4, shuffle=True, seed=9, world_size=2, num_workers=2)
    seen = []
    for r in (0, 1):
        order = [b.tolist() for b in gpufeed.DataLoader(_Indexed(ds), rank=r, **kw)]
        got = list(gpufeed.DataLoader(ds, rank=r, **kw))
        for idx, (images, labels) in zip(order, got, strict=True):
            want = ds.gpufeed_batch(idx, seed=9, epoch=0, alloc=None)
            assert torch.equal(images, want[0]) and torch.equal(labels, want[1])
        seen.append({i for b in order for i in b})
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(len(ds)))


class _Indexed(torch.utils.data.Dataset):
    """A sample's index (which sample each rank got)."""

    def __init__(self, ds):
        self.n = len(ds)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def _tar(path, entries, fmt=tarfile.USTAR_FORMAT):
    with tarfile.open(path, "w", format=fmt) as tf:
        for name, data in entries:
            _add(tf, name, data)
    return str(path)


def test_bad_shards_are_refused_naming_the_fix(tree, tmp_path):
    _, ref, _ = tree
    jpg = _bytes(ref.path(0))
    gz = tmp_path / "a.tar.gz"
    plain = _tar(tmp_path / "a.tar", [("k.jpg", jpg), ("k.cls", b"1")])
    gz.write_bytes(gzip.compress(_bytes(plain)))
    with pytest.raises(ValueError, match=r"compressed with gzip \(gunzip it\).*plain"):
        gpufeed.sources.ImageShards(str(gz), size=8)
    (tmp_path / "text.tar").write_bytes(b"hello " * 200)
    with pytest.raises(ValueError, match=r"text\.tar.*not a tar file"):
        gpufeed.sources.ImageShards(str(tmp_path / "text.tar"), size=8)
    cut = tmp_path / "cut.tar"
    cut.write_bytes(_bytes(tmp_path / "a.tar")[:700])
    with pytest.raises(ValueError, match=r"cut\.tar.*cut short"):
        gpufeed.sources.ImageShards(str(cut), size=8)
    cases = {
        "nolabel": ([("k.jpg", jpg)], r"sample 'k' has no 'cls' label member \(it has: jpg\)"),
        "noimage": ([("k.txt", b"x"), ("k.cls", b"1")],
                    r"sample 'k' has no image member \(jpg, jpeg"),
        "badlabel": ([("k.jpg", jpg), ("k.cls", b"cat")], r"k\.cls holds b'cat'"),
        "twice": ([("k.jpg", jpg), ("k.jpg", jpg)], r"'k\.jpg' twice"),
        "empty": ([("README", b"no dot")], "hold no sample"),
    }
    for name, (entries, match) in cases.items():
        with pytest.raises(ValueError, match=match):
            gpufeed.sources.ImageShards(_tar(tmp_path / f"{name}.tar", entries), size=8)
    with pytest.raises(ValueError, match="must be member extensions"):
        gpufeed.sources.ImageShards(str(tmp_path / "a.tar"), size=8, image=())
    with pytest.raises(TypeError, match="read the shards with webdataset"):
        gpufeed.sources.ImageShards(str(tmp_path / "a.tar"), size=8, target_transform=lambda x: x)
    # a plain shard whose first member's name starts like a compressed file's magic
    named = _tar(tmp_path / "bzh.tar", [("BZh91AY.jpg", jpg), ("BZh91AY.cls", b"2")])
    assert gpufeed.sources.ImageShards(named, size=8).keys[0] == "BZh91AY"
    # other extensions, named
    path = _tar(tmp_path / "other.tar", [("k.webp.jpg", b""), ("k.jpeg", jpg), ("k.label", b"4")])
    ds = gpufeed.sources.ImageShards(path, size=8, image="jpeg", label="label")
    assert ds.targets.tolist() == [4] and ds[0][0].shape == (3, 8, 8)


def _header_offsets(path):
    with tarfile.open(path) as tf:
        return [m.offset for m in tf]


def test_a_damaged_header_is_refused_never_skipped(tree, tmp_path):
    """A damaged header in the middle of a shard is an error naming its byte, in the header
    parser and where tarfile lists the shard (which would end its listing there quietly, and
    lose the samples after it); a header summed over signed bytes, as old writers did, is
    read."""
    _, ref, _ = tree
    jpg = _bytes(ref.path(0))
    entries = [(f"{k}.{e}", jpg if e == "jpg" else b"1") for k in "abc" for e in ("jpg", "cls")]
    for fmt, prefix, match in ((tarfile.USTAR_FORMAT, "", "bad header checksum at byte"),
                               (tarfile.PAX_FORMAT, "ü/", "no tar header at byte")):
        path = _tar(tmp_path / f"{fmt}.tar", [(prefix + n, d) for n, d in entries], fmt)
        assert len(gpufeed.sources.ImageShards(path, size=8)) == 3
        at = _header_offsets(path)[-2]  # c.jpg's header (pax: its extended header)
        data = bytearray(_bytes(path))
        data[at + 130] ^= 0x04  # one bit of the size field
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(ValueError, match=match):
            gpufeed.sources.ImageShards(path, size=8)
    path = _tar(tmp_path / "signed.tar", [("é.jpg", jpg), ("é.cls", b"3")], tarfile.GNU_FORMAT)
    data = bytearray(_bytes(path))
    for at in _header_offsets(path):
        block = data[at:at + 512]
        block[148:156] = b" " * 8
        signed = sum(b - 256 if b > 127 else b for b in block)
        data[at + 148:at + 156] = b"%06o\0 " % signed
    with open(path, "wb") as f:
        f.write(data)
    assert members(path)[0].name == "é.jpg"
    assert gpufeed.sources.ImageShards(path, size=8).targets.tolist() == [3]
    # a size in GNU's base-256 form (how sizes past 8 GiB are written), here a small one
    path = _tar(tmp_path / "b256.tar", [("k.jpg", jpg), ("k.cls", b"5")])
    data = bytearray(_bytes(path))
    data[124:136] = b"\x80" + len(jpg).to_bytes(11, "big")
    data[148:156] = b" " * 8
    data[148:156] = b"%06o\0 " % sum(data[:512])
    with open(path, "wb") as f:
        f.write(data)
    with tarfile.open(path) as tf:
        assert members(path) == [(m.name, m.offset_data, m.size) for m in tf]
    assert gpufeed.sources.ImageShards(path, size=8)._read(0) == jpg


def test_a_changed_or_damaged_shard_is_named(tree, tmp_path):
    _, ref, _ = tree
    jpg = _bytes(ref.path(0))
    entries = [("a.jpg", jpg), ("a.cls", b"0"), ("b.jpg", b"\xff\xd8\xff" + b"junk" * 30),
               ("b.cls", b"1")]
    path = _tar(tmp_path / "s.tar", entries)
    ds = gpufeed.sources.ImageShards(path, size=8)
    with pytest.raises(ValueError, match=r"b\.jpg in shard .*s\.tar.*on_error='skip'"):
        list(gpufeed.DataLoader(ds, batch_size=2))
    skip = gpufeed.sources.ImageShards(path, size=8, on_error="skip")
    assert gpufeed.DataLoader(skip, batch_size=2).__iter__().__next__()[1].tolist() == [0, -1]
    with open(path, "ab") as f:
        f.write(b"\0" * 1024)
    for d in (ds, skip):  # every sample's offsets are in doubt: an error even when skipping
        with pytest.raises(RuntimeError, match=r"s\.tar.*changed since the dataset indexed it"):
            d[0]
        with pytest.raises(RuntimeError, match="changed since"):
            list(gpufeed.DataLoader(d, batch_size=2, num_workers=2))


@pytest.mark.usefixtures("no_leaks")
def test_reads_keep_no_descriptor(tree):
    """A thousand shards need no ``ulimit -n``: no descriptor stays open between reads, in
    the main process or in thread workers."""
    _, _, paths = tree
    ds = gpufeed.sources.ImageShards(paths, size=8)
    before = len(os.listdir("/proc/self/fd"))
    for _ in gpufeed.DataLoader(ds, batch_size=4, num_workers=2, worker_type="thread"):
        pass
    ds.gpufeed_batch(list(range(len(ds))), seed=0, epoch=0, alloc=None)
    assert len(os.listdir("/proc/self/fd")) == before


def test_repr_names_the_shards(tree):
    _, _, paths = tree
    text = repr(gpufeed.sources.ImageShards(paths, size=8, crop="center"))
    assert text.startswith("Dataset ImageShards\n    Number of datapoints: 18\n")
    assert "part-000.tar ... " in text and "Shards: 3, image=jpg/" in text
