"""The docs cannot rot: the site builds strictly, every Python example runs, the API reference
lists every public name, and the README's benchmark table is the committed results' table.

- ``mkdocs build --strict`` (once per session, into a temporary folder): a broken link or
  anchor, a page missing from the navigation, a name the API reference cannot resolve, or a
  docstring mkdocstrings cannot read fails the build.
- Every ```python block of README.md and docs/**/*.md runs on CPU: each page in a process of its
  own (forked from one that imported torch once), each block in a fresh namespace and a fresh
  temporary working directory (so it makes its own small data), with a time limit per page. A
  block that cannot run on CPU (a launch command, multi-node, a GPU only) is written as
  ```text or ```bash, which are not run.
- Each name in the ``__all__`` of ``gpufeed`` and of every public submodule has its entry in
  the built API reference.
- The benchmark figures and charts come from the committed results (``bench/charts.py``).

Run time: about 25 s of CPU in all (the build about 10 s, the examples about 8 s); minutes of
wall time on a loaded machine.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
#: the public modules and their reference pages (``::: module`` on each)
REFERENCE = {"gpufeed": "gpufeed", "gpufeed.sources": "sources",
             "gpufeed.samplers": "samplers", "gpufeed.random": "random",
             "gpufeed.stats": "stats", "gpufeed.tools": "tools", "gpufeed.errors": "errors",
             "gpufeed.hf": "hf"}
#: optional packages a docs example may need; without one, that page's examples skip
OPTIONAL = {"PIL", "simplejpeg", "datasets", "pyarrow", "h5py", "matplotlib"}
PAGE_TIMEOUT_S = 240


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"),
                                                      env.get("PYTHONPATH")]))
    env["NO_MKDOCS_2_WARNING"] = "1"
    return env


# --- the strict build ---------------------------------------------------------------------------

@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs tools are not installed: "
                        "pip install mkdocs-material 'mkdocstrings[python]'")
    pytest.importorskip("mkdocstrings_handlers.python",
                        reason="mkdocstrings' Python handler is not installed: "
                        "pip install 'mkdocstrings[python]'")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(out), "--config-file", str(REPO / "mkdocs.yml")],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    problems = [ln for ln in done.stderr.splitlines() if "WARNING" in ln or "ERROR" in ln]
    assert done.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(
        problems or done.stderr.splitlines()[-30:])
    return out


def test_site_builds_strictly(site):
    assert (site / "index.html").is_file()
    assert (site / "reference" / "cli" / "index.html").is_file()


def test_api_reference_lists_every_public_name(site):
    """Each module's ``__all__`` is rendered (mkdocstrings follows it): every name has its
    anchor on the module's page; a name mkdocstrings leaves out (dunders) is in the page's
    text."""
    missing = []
    for module, page in REFERENCE.items():
        source = (DOCS / "reference" / f"{page}.md").read_text()
        assert f"::: {module}\n" in source, f"docs/reference/{page}.md does not render {module}"
        html = (site / "reference" / page / "index.html").read_text()
        for name in importlib.import_module(module).__all__:
            if name.startswith("_"):
                if name not in source:
                    missing.append(f"{module}.{name} (not in docs/reference/{page}.md)")
            elif f'id="{module}.{name}"' not in html:
                missing.append(f"{module}.{name} (no entry on reference/{page})")
    assert not missing, "the API reference lacks:\n" + "\n".join(missing)


def test_every_public_module_has_a_reference_page():
    import gpufeed

    public = {f"gpufeed.{n}" for n, v in vars(gpufeed).items()
              if not n.startswith("_") and type(v).__name__ == "module"}
    assert public | {"gpufeed"} <= set(REFERENCE), public - set(REFERENCE)


def test_cli_reference_shows_every_command(site):
    html = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("bench", "tune", "profile", "doctor"):
        assert f"usage: gpufeed {command}" in html, command


def test_readme_links_point_at_files():
    """The README is not part of the site: its relative links are checked here."""
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "the README links into the docs"
    broken = [link for link in local if not (REPO / link).exists()]
    assert not broken, f"README.md links to missing files: {broken}"


# --- the examples -------------------------------------------------------------------------------

def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(line, code) of each ```python block of a Markdown file (indented blocks too)."""
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```python\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, start, body = m.group(1), i + 1, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        blocks.append((start + 1, "\n".join(body) + "\n"))
        i += 1
    return blocks


#: Runs the pages' blocks: torch and gpufeed are imported once, then each page runs in a child
#: forked from that process (its own memory, so pages cannot leak into each other), each block
#: in a fresh namespace and a fresh temporary folder; one JSON line of results per page.
RUNNER = textwrap.dedent("""
    import json, os, select, sys, tempfile, time, traceback
    import numpy, torch, gpufeed
    pages, limit = json.load(sys.stdin), float(sys.argv[1])

    def run_page(rel, blocks):
        results = []
        for line, code in blocks:
            os.chdir(tempfile.mkdtemp(prefix="gpufeed-docs-"))
            started = time.perf_counter()
            try:
                exec(compile(code, f"{rel}:{line}", "exec"), {"__name__": "__main__"})
                results.append({"line": line, "ok": True})
            except ModuleNotFoundError as e:
                results.append({"line": line, "ok": False, "missing": e.name,
                                "error": traceback.format_exc()})
            except BaseException:
                results.append({"line": line, "ok": False, "error": traceback.format_exc()})
            results[-1]["seconds"] = round(time.perf_counter() - started, 2)
        return results

    for rel, blocks in pages.items():
        read, write = os.pipe()
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                out = run_page(rel, blocks)
            except BaseException:
                out = [{"line": 0, "ok": False, "error": traceback.format_exc()}]
            os.write(write, json.dumps(out).encode())
            os._exit(0)
        os.close(write)
        data = b""
        while True:
            left = max(0.0, limit - (time.perf_counter() - started))
            ready, _, _ = select.select([read], [], [], left)
            if not ready:
                os.kill(pid, 9)
                data = json.dumps([{"line": 0, "ok": False,
                                    "error": f"timed out after {limit:.0f} s"}]).encode()
                break
            chunk = os.read(read, 1 << 16)
            if not chunk:
                break
            data += chunk
        os.close(read)
        os.waitpid(pid, 0)
        seconds = round(time.perf_counter() - started, 2)
        print("RESULTS " + json.dumps({"page": rel, "seconds": seconds,
                                       "results": json.loads(data or b"[]")}), flush=True)
""")

PAGES_WITH_CODE = [p for p in PAGES if python_blocks(p)]


def test_the_docs_have_examples():
    assert REPO / "README.md" in PAGES_WITH_CODE
    assert sum(len(python_blocks(p)) for p in PAGES_WITH_CODE) >= 15


@pytest.fixture(scope="module")
def examples() -> dict[str, dict]:
    """Every page's examples, run once: page -> {"seconds", "results"}."""
    pages = {p.relative_to(REPO).as_posix(): python_blocks(p) for p in PAGES_WITH_CODE}
    done = subprocess.run([sys.executable, "-c", RUNNER, str(PAGE_TIMEOUT_S)],
                          input=json.dumps(pages), cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=PAGE_TIMEOUT_S * len(pages))
    out = {}
    for line in done.stdout.splitlines():
        if line.startswith("RESULTS "):
            record = json.loads(line.removeprefix("RESULTS "))
            out[record.pop("page")] = record
    assert out or done.returncode == 0, f"the examples' runner failed (rc {done.returncode}):\n" \
        + done.stderr[-3000:]
    return out


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: p.relative_to(REPO).as_posix())
def test_python_examples_run(page, examples):
    rel = page.relative_to(REPO).as_posix()
    assert rel in examples, f"{rel}: its examples did not finish (the runner stopped)"
    results = examples[rel]["results"]
    failed = [r for r in results if not r["ok"]]
    missing = {r.get("missing") for r in failed}
    if failed and missing <= OPTIONAL and None not in missing:
        pytest.skip(f"{rel}: an example needs {', '.join(sorted(missing))}, not installed")
    assert not failed, "\n".join(f"{rel}:{r['line']} failed:\n{r['error']}" for r in failed)
    assert len(results) == len(python_blocks(page))


# --- the README's figures -----------------------------------------------------------------------

def _charts():
    sys.path.insert(0, str(REPO))
    try:
        from bench import charts
    finally:
        sys.path.remove(str(REPO))
    return charts


def test_charts_are_drawn_from_the_committed_results(tmp_path):
    """``python -m bench.charts`` redraws the benchmarks page's charts from the results JSON,
    and the page shows each chart it makes."""
    pytest.importorskip("matplotlib", reason="the charts need matplotlib (the plot extra)")
    charts = _charts()
    assert charts.main(["--out", str(tmp_path)]) == 0
    page = (DOCS / "benchmarks.md").read_text()
    for png in ("throughput.png", "autotune.png"):
        assert (tmp_path / png).stat().st_size > 10_000, png
        assert (DOCS / "assets" / "charts" / png).is_file(), png
        assert f"assets/charts/{png}" in page, png
    assert len(charts.trajectories(json.loads(
        (charts.results_dir() / "autotune.json").read_text()))) >= 2


def test_readme_table_is_the_committed_results():
    """The README's and the benchmarks page's headline table is what ``bench/charts.py`` makes
    of the committed CPU results."""
    charts = _charts()
    table = charts.headline_table(json.loads((charts.results_dir() / "cpu.json").read_text()))
    for page in (REPO / "README.md", DOCS / "benchmarks.md"):
        assert table in page.read_text(), f"{page.relative_to(REPO)}: the table is not\n{table}"


def test_peers_and_ray_tables_are_the_committed_results():
    """The benchmarks page's side-by-side tables are what ``bench/charts.py`` makes of the
    committed results of ``bench.peers`` and ``bench.ray_handoff``."""
    charts = _charts()
    page = (DOCS / "benchmarks.md").read_text()
    for name, table in (("peers", charts.peers_table), ("ray", charts.ray_table)):
        expected = table(json.loads((charts.results_dir() / f"{name}.json").read_text()))
        assert expected in page, f"docs/benchmarks.md: the {name} table is not\n{expected}"
