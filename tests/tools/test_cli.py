import io
import json
import math
import os
import platform
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import gpufeed
import gpufeed._cli.main
from gpufeed._cli.main import main

USER_MODULE = """
import time

import torch


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 512

    def __getitem__(self, i):
        return torch.full((4,), float(i * i))


def make():
    return Squares()


def not_a_dataset():
    return 42


VALUE = 3


def loop(profiler):
    for _ in profiler.wrap(torch.utils.data.DataLoader(Squares(), batch_size=16)):
        time.sleep(0.001)


def pair():
    return range(20), lambda batch: time.sleep(0.001)


def bad_pair():
    return 5


def one_step():
    return range(1), lambda batch: None


def no_wrap(profiler):
    pass


def broken():
    raise RuntimeError("the user's bug")


class Ragged(torch.utils.data.Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        return torch.arange(1 + i % 7)


def padded():
    return Ragged()


def pad(samples):
    return torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)


def gpufeed_loop(profiler):
    import gpufeed  # process workers start slowly; later batches are ready at once

    loader = gpufeed.DataLoader(Squares(), batch_size=16, num_workers=2, prefetch_factor=8)
    for _ in profiler.wrap(loader):
        time.sleep(0.005)
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "cli_user_mod.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "cli_user_mod"


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["tune", "--help"],
                                  ["profile", "--help"], ["doctor", "--help"]])
def test_help_of_every_command(argv, capsys):
    assert main(argv) == 0
    assert "usage: gpufeed" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [[], ["fly"], ["tune"], ["tune", "m:f", "--batch-size", "0"],
                                  ["tune", "m:f", "--budget", "lots"],
                                  ["bench", "--workers", "a,b"], ["doctor", "--workers", "-1"],
                                  ["doctor", "--batch-bytes", "big"],
                                  # checked before a run, not after it (or never)
                                  ["bench", "--workers", "-1"], ["bench", "--workers", ","],
                                  ["bench", "--seconds", "nan"], ["tune", "m:f", "--runs", "inf"],
                                  ["bench", "--json", "/no/such/folder/b.json"],
                                  ["bench", "--plot", "/no/such/folder/b.png"],
                                  ["profile", "m:f", "--trace", "-"]])
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "usage: gpufeed" in capsys.readouterr().err


@pytest.mark.parametrize("argv, fix", [
    (["doctor", "--workers", "0", "--prefetch-factor", "5"], "with --workers 0 there are none"),
    (["profile", "m:f", "--trace-last", "5"], "add --trace FILE"),
    (["profile", "m:f", "--trace", "/tmp/t.json", "--stall-ms", "3", "--timeline-start", "1"],
     "--timeline-start, --stall-ms shape the picture: add --timeline FILE.png")])
def test_options_that_would_be_ignored_are_usage_errors(argv, fix, capsys):
    """Checked before anything runs (``m:f`` is never imported), naming the option and fix."""
    assert main(argv) == 2
    assert fix in capsys.readouterr().err


def png_is_a_real_chart(path, min_size=(300, 200)):
    """Open the PNG with Pillow: big enough, and not one flat colour (a blank canvas)."""
    Image = pytest.importorskip("PIL.Image")
    with Image.open(path) as im:
        assert im.format == "PNG"
        assert im.size[0] >= min_size[0] and im.size[1] >= min_size[1], im.size
        gray = im.convert("L")
        lo, hi = gray.getextrema()
        assert hi - lo > 100, "blank image"
        # drawn pixels (axes, bars, text): well above a frame's worth, well below all
        dark = sum(gray.histogram()[:200])
        assert 0.005 < dark / (im.size[0] * im.size[1]) < 0.9


def test_bench_builtin_workload(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--quick", "--seconds", "0.05", "--workers", "0", "--runs", "3",
               "--no-progress", "--json", str(out), "--plot", str(png)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "built-in synthetic workload" in text and "gpufeed vs stock, both per-sample" in text
    assert "batched-path gain: gpufeed array vs gpufeed per-sample" in text
    assert "machine busy" in text or "machine quiet" in text
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    # both loaders on every fetch path: like for like
    assert {(r["loader"], r["path"]) for r in rows} == {
        (lo, p) for lo in ("torch", "gpufeed") for p in ("per-sample", "getitems", "array")}
    assert all(len(r["spread"]["runs"]) == 3 and r["samples_per_s"] > 0 for r in rows)
    assert all(r["spread"]["lo"] <= r["samples_per_s"] <= r["spread"]["hi"] for r in rows)
    whats = [c["what"] for c in doc["comparisons"]]
    assert len(whats) == 5 and all(c["ratio_lo"] <= c["ratio"] <= c["ratio_hi"]
                                   for c in doc["comparisons"])
    assert {"busy", "other_cpus", "steal_share"} <= set(doc["machine"])
    png_is_a_real_chart(png)


def test_bench_user_dataset(user_module, capsys):
    assert main(["bench", f"{user_module}:make", "--workers", "0", "--seconds", "0.2",
                 "--batch-size", "16", "--runs", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"gpufeed bench: {user_module}:make, batch_size=16" in out


@pytest.mark.parametrize(("target", "message"), [
    ("no_colon", "expected MODULE:FACTORY (e.g. mypkg.data:factory), got 'no_colon'"),
    ("no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'"),
    ("{mod}:missing", "has no attribute 'missing'"),
    ("{mod}:VALUE", "is a int, not a callable"),
    ("{mod}:not_a_dataset", "returned a int, not a dataset"),
    ("missing_file.py:make", "no file 'missing_file.py'"),
])
def test_bad_targets_name_the_value_and_the_form(user_module, target, message, capsys):
    target = target.format(mod=user_module)
    assert main(["bench", target, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("gpufeed bench: error:")


def test_target_from_a_file_path(tmp_path, capsys):
    path = tmp_path / "by_path.py"
    path.write_text(textwrap.dedent(USER_MODULE))
    assert main(["profile", f"{path}:pair"]) == 0
    assert "input-bound:" in capsys.readouterr().out


def test_tune_writes_recommendation_json(user_module, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "tune.json", tmp_path / "tune.png"
    rc = main(["tune", f"{user_module}:make", "--batch-size", "16", "--worker-types", "thread",
               "--trial-seconds", "0.1", "--runs", "3", "--time-budget", "4", "--no-progress",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "recommended" in text and ("machine busy" in text or "machine quiet" in text)
    data = json.loads(out.read_text())
    assert set(data["recommended"]) >= {"num_workers", "pin_memory"}
    assert data["trials"] and "samples_per_s" in data["trials"][0]
    assert all(len(t["runs"]) == 3 for t in data["trials"] if t["accepted"])
    assert isinstance(data["machine_busy"], bool)
    png_is_a_real_chart(png)


def test_tune_with_collate_step_and_budgets(user_module, tmp_path, capsys):
    out = tmp_path / "tune.json"
    rc = main(["tune", f"{user_module}:padded", "--collate", f"{user_module}:pad",
               "--step-ms", "5", "--batch-size", "8", "--worker-types", "thread",
               "--trial-seconds", "0.1", "--runs", "1", "--time-budget", "3", "--no-progress",
               "--budget-memory", "64GiB", "--budget-shm", "1TiB", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "input-bound" in text
    data = json.loads(out.read_text())
    assert data["budget"]["memory_bytes"] == 64 << 30 and data["budget"]["shm_bytes"] == 1 << 40
    assert all(t["input_bound"] is not None for t in data["trials"])
    # without --collate the default collate cannot stack the ragged samples: no trial works
    rc = main(["tune", f"{user_module}:padded", "--batch-size", "8", "--worker-types", "thread",
               "--trial-seconds", "0.1", "--runs", "1", "--time-budget", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "no configuration worked" in err and "--collate MODULE:FUNCTION" in err
    assert "raise the budget" not in err and "Traceback" not in err


def test_tune_step_and_step_ms_are_exclusive(user_module, capsys):
    assert main(["tune", f"{user_module}:make", "--step", f"{user_module}:pad",
                 "--step-ms", "3"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("function", ["loop", "pair"])
def test_profile_both_function_forms(user_module, function, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", f"{user_module}:{function}", "--json", str(out)]) == 0
    assert "input-bound:" in capsys.readouterr().out
    assert json.loads(out.read_text())["steps"] > 0


def test_profile_bad_return_and_user_errors(user_module, capsys):
    assert main(["profile", f"{user_module}:bad_pair"]) == 2
    assert "return (iterable, step)" in capsys.readouterr().err
    assert main(["profile", f"{user_module}:broken"]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: the user's bug" in err and "Traceback" in err


@pytest.mark.parametrize("target, warmup", [("one_step", []), ("no_wrap", []),
                                            ("pair", ["--warmup", "30"])])
def test_profile_that_measured_nothing_fails_and_says_why(user_module, target, warmup, capsys):
    """No step after the warm-up gives no verdict: exit 1 (a script must not read a pass)."""
    assert main(["profile", f"{user_module}:{target}", "--no-progress", *warmup]) == 1
    err = capsys.readouterr().err
    assert "no steps measured" in err and "give it more batches" in err
    assert ("lower --warmup" in err) == bool(warmup)


def test_tune_bad_worker_type_is_a_usage_error(user_module, capsys):
    assert main(["tune", f"{user_module}:make", "--worker-types", "fiber"]) == 2
    assert "worker_types must name 'process' and/or 'thread'" in capsys.readouterr().err


def test_doctor_exit_code_and_json(tmp_path, capsys):
    out = tmp_path / "d.json"
    rc = main(["doctor", "--json", str(out)])
    data = json.loads(out.read_text())
    assert rc == data["exit_code"] in (0, 1)
    assert "gpufeed doctor" in capsys.readouterr().out
    main(["doctor", "--workers", "0", "--no-pin-memory", "--batch-bytes", "1MiB",
          "--json", str(out)])
    names = {f["name"] for f in json.loads(out.read_text())["findings"]}
    assert "/dev/shm" not in names and "RLIMIT_MEMLOCK" not in names  # do not apply
    assert "0 workers x prefetch 2" in capsys.readouterr().out


def test_plot_without_matplotlib_says_how_to_install(user_module, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    rc = main(["tune", f"{user_module}:make", "--plot", str(tmp_path / "t.png")])
    assert rc == 1
    assert "pip install 'gpufeed[plot]'" in capsys.readouterr().err


def test_python_dash_m_gpufeed(tmp_path):
    src = str(Path(gpufeed._cli.main.__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "d.json"
    done = subprocess.run([sys.executable, "-m", "gpufeed", "doctor", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode in (0, 1), done.stderr
    assert "gpufeed doctor" in done.stdout and json.loads(out.read_text())["findings"]


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize(("argv", "terminal", "drawn"), [
    ([], True, True), (["--json", "{out}"], True, False), ([], False, False),
    (["--no-progress"], True, False)])
def test_progress_bar_only_on_a_terminal_and_without_json(user_module, tmp_path, monkeypatch,
                                                           capsys, argv, terminal, drawn):
    pytest.importorskip("tqdm")
    err = FakeTerminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    extra = [a.format(out=tmp_path / "o.json") for a in argv]
    assert main(["profile", f"{user_module}:pair", *extra]) == 0
    assert main(["tune", f"{user_module}:make", "--worker-types", "thread", "--runs", "1",
                 "--trial-seconds", "0.05", "--time-budget", "0.5", *extra]) == 0
    text = err.getvalue()
    assert ("gpufeed profile" in text and "gpufeed tune" in text) is drawn, text
    assert "input-bound" in capsys.readouterr().out  # the results still go to stdout


def test_bench_collate_takes_samples_of_different_sizes(user_module, capsys):
    argv = ["bench", f"{user_module}:padded", "--workers", "0,2", "--worker-type", "thread",
            "--seconds", "0.05", "--runs", "3", "--no-progress"]
    assert main([*argv, "--collate", f"{user_module}:pad"]) == 0, capsys.readouterr().err
    assert "gpufeed vs stock, both yours" in capsys.readouterr().out
    # without it the default collate cannot stack them: the error names the fix, as tune's does
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "stack expects each tensor" in err and "--collate MODULE:FUNCTION" in err
    assert "Traceback" not in err
    # the built-in workload brings its own collate functions
    assert main(["bench", "--collate", f"{user_module}:pad", "--no-progress"]) == 2
    assert "give MODULE:FACTORY too" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "table"), [(["doctor"], "gpufeed doctor"),
                                             (["profile", "{mod}:pair"], "gpufeed profile:")])
def test_json_dash_writes_the_json_alone_to_stdout(user_module, tmp_path, monkeypatch, capsys,
                                                   argv, table):
    monkeypatch.chdir(tmp_path)
    rc = main([*(a.format(mod=user_module) for a in argv), "--json", "-"])
    out, err = capsys.readouterr()
    assert rc in (0, 1)
    doc = json.loads(out)  # nothing but the JSON on stdout
    assert doc.get("findings") or doc.get("steps")
    assert table in err and "wrote" not in out + err  # the table went to stderr
    assert not (tmp_path / "-").exists()


def test_plot_dash_is_refused_naming_the_fix(capsys):
    assert main(["bench", "--plot", "-"]) == 2
    assert "cannot take this file (an image or a trace); give a file name" in \
        capsys.readouterr().err


def test_version_names_gpufeed_torch_and_python(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"gpufeed {gpufeed.__version__} (torch {torch.__version__}, ")
    assert ("CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}") in out
    assert f"Python {platform.python_version()}" in out


def test_the_version_is_the_one_the_package_is_built_with():
    pyproject = (Path(gpufeed._cli.main.__file__).parents[3] / "pyproject.toml").read_text()
    found = re.search(r'^version = "([^"]+)"', pyproject, flags=re.M)
    assert found and found.group(1) == gpufeed.__version__


def test_profile_prints_one_input_bound_share(user_module, tmp_path, capsys):
    """The profile's share and the loader's table agree: the share is printed once, over the
    steps measured, and the JSON holds the same figure."""
    out = tmp_path / "p.json"
    assert main(["profile", f"{user_module}:gpufeed_loop", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["loader_stats"]["counters"]["batches"] == 32  # the loader's table is there too
    assert "gpufeed loader stats" in text
    shares = re.findall(r"input-bound: (\d+)%", text)
    assert shares == [f"{doc['input_bound']:.0%}".rstrip("%")], (shares, text)
    assert math.isclose(doc["input_bound"], doc["wait_s"] / doc["wall_s"])
