"""The structure gate: the package's shape, checked from its source text alone.

Nothing here imports gpufeed; every check reads the files under ``src/gpufeed``, whatever they are:

- imports form no cycle, counting ``if TYPE_CHECKING:`` and function-level imports too, and
  ``import gpufeed`` as an edge to the package's ``__init__``;
- a stage folder's ``__init__.py`` holds only its docstring, and every import points down the
  floors of ``FOLDER_FLOORS``/``ROOT_FLOORS`` (stage folders, the loader, tools, the public API);
- every ``NOTE [ Name ]`` reference names exactly one NOTE definition, in the file it says;
- ``docs/how-it-works/module-map.md`` maps every module with its role;
- no module is longer than ``MAX_LINES``.
"""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "src" / "gpufeed"
MAP = REPO / "docs" / "how-it-works" / "module-map.md"  # the module map and the NOTE index
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under src/gpufeed."""
    mods = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = ("gpufeed", *path.relative_to(PKG).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


# --- imports ----------------------------------------------------------------------------------

def _imports(module: str, path: Path, known: set[str]) -> dict[str, int]:
    """gpufeed modules that ``module`` imports anywhere in its file -> first line doing so."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        if name in known:
            found.setdefault(name, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x / from ..x import y, relative to this package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # a submodule imported by name is an edge to it
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else base, node.lineno)
        elif (isinstance(node, ast.Call) and node.args  # importlib.import_module("gpufeed...")
              and isinstance(node.func, ast.Attribute | ast.Name)
              and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            add(node.args[0].value, node.lineno)
    return found


def _graph() -> dict[str, dict[str, int]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a module importing itself):
    two modules share one when each reaches the other."""
    reach = {}
    for start in graph:
        seen: set[str] = set()
        todo = list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
        reach[start] = seen
    comps = {frozenset({m} | {n for n in reach[m] if m in reach[n]}) for m in graph}
    return sorted(sorted(c) for c in comps if len(c) > 1 or next(iter(c)) in graph[next(iter(c))])


def test_no_import_cycles():
    graph, mods = _graph(), _modules()
    report = []
    for comp in _cycles(graph):
        edges = [f"    {a} -> {b} ({_rel(mods[a])}:{graph[a][b]})"
                 for a in comp for b in sorted(graph[a]) if b in comp]
        report.append(f"cycle of {len(comp)}: {', '.join(comp)}\n" + "\n".join(edges))
    assert not report, f"{len(report)} import cycle(s):\n" + "\n".join(report)


def test_subpackage_inits_have_no_imports():
    bad = []
    for path in sorted(PKG.rglob("__init__.py")):
        if path.parent == PKG:
            continue
        body = ast.parse(path.read_text()).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring: the stage's map
        if body:
            bad.append(f"{_rel(path)}:{body[0].lineno}: {ast.unparse(body[0]).splitlines()[0]}")
    assert not bad, "a stage folder's __init__.py holds only its docstring:\n" + "\n".join(bad)


# The floors, from the ground up: a module imports only from its own floor or below.
FOLDER_FLOORS = {"_base": 0, "_order": 1, "_sources": 2, "_memory": 3, "_host": 4,
                 "_device": 5, "_tools": 7, "_cli": 10}
ROOT_FLOORS = {"_loader.py": 6, "__init__.py": 8, "__main__.py": 10,
               # the public submodules, beside the package's __init__
               "errors.py": 8, "random.py": 8, "samplers.py": 8, "sources.py": 8, "stats.py": 8,
               "tools.py": 8, "hf.py": 8}
# (importer, imported) -> why it may point up. None is needed: __init__ (8) imports every
# floor below it, and _cli (10) imports the tools: all point down. (The benchmark lab, ``bench/``
# at the repository's root, is outside the package and free to import any of it.)
UPWARD_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _floor(path: Path) -> int | None:
    rel = path.relative_to(PKG)
    return FOLDER_FLOORS.get(rel.parts[0]) if len(rel.parts) > 1 else ROOT_FLOORS.get(rel.name)


def test_dependencies_point_down():
    """Meant for the tree of stage folders: a module at the root other than _loader.py,
    __init__.py and __main__.py is in no stage folder, and fails here."""
    graph, mods = _graph(), _modules()
    floors = {m: _floor(p) for m, p in mods.items()}
    bad = [f"module {m} ({_rel(mods[m])}) is in no stage folder"
           for m, f in floors.items() if f is None]
    for a, targets in graph.items():
        for b, line in targets.items():
            fa, fb = floors[a], floors[b]
            if fa is not None and fb is not None and fb > fa and (a, b) not in UPWARD_EXCEPTIONS:
                bad.append(f"{a} (floor {fa}) imports {b} (floor {fb}) at {_rel(mods[a])}:{line}")
    assert not bad, "imports must point down the floors:\n" + "\n".join(bad)


# --- NOTE references --------------------------------------------------------------------------
# A NOTE is defined in one of two forms, at the start of a line (in a docstring or a # comment):
#   NOTE [ Name ]            a heading, followed by a line of dashes
#   NOTE [ Name ]: text      inline, the start of a docstring paragraph
# Any other ``NOTE [ Name ]`` is a reference, wrapped across lines and # prefixes or not. After
# the ``]`` it may carry a qualifier, ``(3)``, ``(a)``, ``rule (3)``, ``, case 4``, which the
# NOTE's text must contain as ``(3)`` or as a list item ``4.``; and a place, `` in `path` ``,
# ``in path.py``, ``, path.py`` or ``(`path`)`` (a file path or a dotted ``gpufeed.`` module),
# which must be the file defining it. A NOTE's text runs from its definition to the next
# definition, the end of its docstring (the next line with triple quotes) or, for a NOTE in
# # comments, the end of those comments.

EXTERNAL_NOTES = {"DataLoader on Linux and open files limit"}  # torch's dataloader.py
_REF = re.compile(r"NOTE\s*\[\s*(?P<name>[^\[\]]+?)\s*\]")
_DEF = re.compile(r"^[ \t]*(?:\"\"\"|''')?(?P<note>NOTE \[ (?P<name>[^\[\]\n]+?) \])"
                  r"(?::|[ \t]*\n[ \t]*-{3,}[ \t]*$)", re.M)
_PLACE = r"``[^`]+``|`[^`]+`|[\w/]+\.py\b|gpufeed[\w.]*\w"
_TAIL = re.compile(r"`?(?:\s*,?\s*(?:rule|case)\s+\(?(?P<rule>\d+|[a-z])\)?"
                   r"|\s*\((?P<mark>\d+|[a-z])\))?"
                   rf"(?:\s+in\s+(?P<in>{_PLACE})|,\s*(?P<comma>[\w/]+\.py\b)"
                   rf"|\s*\((?P<paren>``[^`]+``|`[^`]+`)\))?")
_BARE = re.compile(r"\bNOTE\s+(?:in|rule)\b")


def _note_files() -> list[Path]:
    """Where NOTEs are defined and cited: the code, the tests, the lab and the docs."""
    files = [*(REPO / "src").rglob("*.py"), *(REPO / "tests").rglob("*.py"),
             *(REPO / "bench").rglob("*.py"), REPO / "README.md", *(REPO / "docs").rglob("*.md")]
    me = Path(__file__).resolve()
    return sorted(p for p in files if p.is_file() and p.resolve() != me)


def _unwrap(text: str) -> str:
    """The text with each line's leading ``#`` removed, so that wrapped comments read as one;
    line numbers are unchanged."""
    return re.sub(r"\n[ \t]*#+", "\n", "\n" + text)[1:]


def _name(raw: str) -> str:
    return " ".join(raw.split())


def _place(raw: str | None) -> str | None:
    """A reference's place as a path suffix (``_ring.py``, ``gpufeed/_measure.py``), if any."""
    p = (raw or "").strip("`")
    if not re.fullmatch(r"[\w./]+", p) or not (p.endswith(".py") or p.startswith("gpufeed")):
        return None
    return p if p.endswith(".py") else p.replace(".", "/") + ".py"


def _definitions(files: list[Path]) -> dict[str, list[tuple[Path, int, str]]]:
    """Name -> [(file, line, text of the NOTE)]."""
    defs: dict[str, list[tuple[Path, int, str]]] = {}
    for path in files:
        raw_lines = path.read_text().splitlines()
        text = _unwrap(path.read_text())
        lines = text.splitlines()
        starts = [text.count("\n", 0, m.start()) for m in _DEF.finditer(text)]
        for m, start in zip(_DEF.finditer(text), starts, strict=True):
            comment = raw_lines[start].lstrip().startswith("#")
            end = start + 1
            while end < len(lines) and end not in starts:
                if comment and not raw_lines[end].lstrip().startswith("#"):
                    break
                end += 1
                if not comment and re.search("\"\"\"|'''", lines[end - 1]):
                    break
            name = _name(m.group("name"))
            defs.setdefault(name, []).append((path, start + 1, "\n".join(lines[start:end])))
    return defs


def test_note_references():
    files = _note_files()
    defs = _definitions(files)
    bad = [f"NOTE [ {n} ] is defined {len(d)} times: "
           + ", ".join(f"{_rel(p)}:{line}" for p, line, _ in d) for n, d in defs.items()
           if len(d) > 1]
    count = 0
    for path in files:
        text = _unwrap(path.read_text())
        def_at = {m.start("note") for m in _DEF.finditer(text)}
        for m in _BARE.finditer(text):
            at = f"{_rel(path)}:{text.count(chr(10), 0, m.start()) + 1}"
            bad.append(f"{at}: '{m.group()}' names no NOTE: write NOTE [ Name ]")
        for m in _REF.finditer(text):
            name = _name(m.group("name"))
            if m.start() in def_at or name in EXTERNAL_NOTES:
                continue
            count += 1
            at = f"{_rel(path)}:{text.count(chr(10), 0, m.start()) + 1}: NOTE [ {name} ]"
            if name not in defs:
                near = [n for n in defs if name.lower() in n.lower()]
                near = near or difflib.get_close_matches(name, defs, n=2, cutoff=0.5)
                bad.append(f"{at} is defined nowhere; did you mean: {' or '.join(near)}?" if near
                           else f"{at} is defined nowhere")
                continue
            where, line, body = defs[name][0]
            tail = _TAIL.match(text, m.end())
            assert tail  # every part of it is optional
            place = _place(tail.group("in") or tail.group("comma") or tail.group("paren"))
            if place and not f"/{_rel(where)}".endswith(f"/{place}"):
                bad.append(f"{at} says it is in {place}, but it is defined in "
                           f"{_rel(where)}:{line}")
            mark = tail.group("rule") or tail.group("mark")
            if mark and f"({mark})" not in body and not re.search(rf"^\s*{mark}\.\s", body, re.M):
                bad.append(f"{at} cites ({mark}), which the NOTE at {_rel(where)}:{line} "
                           "does not have")
    assert count, "no NOTE reference found: the pattern is broken"
    assert not bad, f"{len(bad)} wrong NOTE reference(s):\n" + "\n".join(bad)


# --- the module map -----------------------------------------------------------------------------
# docs/how-it-works/module-map.md holds the map: a fenced code block whose first line is
# ``src/gpufeed/``, then one line per file or folder, indented two spaces a level:
#     _base/             floor 0: what every stage uses
#       errors.py        WorkerError, RemoteError, capture
# A folder's name ends with ``/``; every ``.py`` file has a role after its name (a role may go on
# over lines indented deeper than the file's name); other files (README.md, py.typed) may be
# listed.

def _map(readme: Path) -> dict[str, str]:
    """Listed .py path (relative to src/gpufeed) -> its role."""
    blocks = re.findall(r"^```[^\n]*\n(src/gpufeed/[ \t]*\n.*?)^```", readme.read_text(),
                        re.M | re.S)
    assert blocks, f"{_rel(readme)} has no fenced block starting with the line src/gpufeed/"
    roles: dict[str, str] = {}
    folders: list[tuple[int, str]] = []  # (indent, name) of the open folders
    last: tuple[int, str | None] = (-1, None)  # (indent, path) of the last file
    for line in blocks[0].splitlines()[1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if last[1] and indent > last[0]:  # a file's role, continued
            roles[last[1]] += " " + line.strip()
            continue
        name, _, role = line.strip().partition(" ")
        while folders and folders[-1][0] >= indent:
            folders.pop()
        path = "/".join([*(f for _, f in folders), name.rstrip("/")])
        if name.endswith("/"):
            folders.append((indent, name.rstrip("/")))
            last = (-1, None)
        elif name.endswith(".py"):
            roles[path] = role.strip()
            last = (indent, path)
    return roles


def test_module_map():
    readme = MAP
    assert readme.is_file(), (f"{_rel(readme)} does not exist: it holds the map of the "
                              "package, one line per module with its role")
    roles = _map(readme)
    actual = {p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py")}
    bad = [f"{p} is not in the map" for p in sorted(actual - set(roles))]
    bad += [f"{p} is in the map but does not exist" for p in sorted(set(roles) - actual)]
    bad += [f"{p} has no role in the map" for p, r in sorted(roles.items()) if not r]
    assert not bad, f"{_rel(readme)} and the package disagree:\n" + "\n".join(bad)


def test_module_size():
    sizes = {_rel(p): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    over = [f"{p}: {n} lines" for p, n in sorted(sizes.items()) if n > MAX_LINES]
    assert not over, f"modules over {MAX_LINES} lines (split them by role):\n" + "\n".join(over)


def test_note_index():
    """The map's index lists every NOTE defined in the package, with the file that holds it."""
    readme = MAP.read_text()
    rows = dict(re.findall(r"^\| ([^|]+?) \| `([^`]+)` \|", readme, flags=re.M))
    defined = {name: _rel(where[0][0]).removeprefix("src/gpufeed/")
               for name, where in _definitions(_note_files()).items()
               if _rel(where[0][0]).startswith("src/gpufeed/")}
    bad = [f"NOTE [ {n} ] ({f}) is not in the index" for n, f in defined.items() if n not in rows]
    bad += [f"NOTE [ {n} ] is indexed in {rows[n]} but defined in {f}"
            for n, f in defined.items() if n in rows and rows[n] != f]
    bad += [f"NOTE [ {n} ] is indexed but defined nowhere" for n in rows if n not in defined]
    assert not bad, f"{_rel(MAP)}'s NOTE index is out of date:\n" + "\n".join(bad)


# --- measurement addresses --------------------------------------------------------------------
# A design note keeps its rule and reason in the code and the figures that decided it on a page
# of docs/how-it-works/measurements/, cited by address: measurements/<page>.md#<section>.

MEASUREMENTS = REPO / "docs" / "how-it-works" / "measurements"
_ADDRESS = re.compile(r"measurements/(?P<page>[\w-]+)\.md#(?P<anchor>[\w-]+)")


def _slug(heading: str) -> str:
    """The anchor the docs site gives a heading (Python-Markdown's toc slugify)."""
    text = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", page.read_text(), flags=re.M)
    return {_slug(h) for h in headings}


def test_slug_matches_the_docs_site():
    assert _slug("Fresh slots") == "fresh-slots"
    assert _slug("Ctrl-C that Python drops") == "ctrl-c-that-python-drops"
    assert _slug("Seeding and threads (thread workers)") == "seeding-and-threads-thread-workers"


def test_measurement_addresses_resolve():
    """Every address of a measurements section, in the code, the tests, the lab and the docs,
    names a page that exists and a heading on it."""
    files = [*PKG.rglob("*.py"), *(REPO / "docs").rglob("*.md"), *(REPO / "bench").rglob("*.py")]
    bad, anchors, found = [], {p.stem: _anchors(p) for p in MEASUREMENTS.glob("*.md")}, 0
    for path in files:
        text = path.read_text()
        for m in _ADDRESS.finditer(re.sub(r"\n\s*(#\s*)?", " ", text)):
            found += 1
            page = MEASUREMENTS / f"{m['page']}.md"
            if m["page"] not in anchors:
                bad.append(f"{_rel(path)}: {m.group()}: no page {_rel(page)}")
            elif m["anchor"] not in anchors[m["page"]]:
                bad.append(f"{_rel(path)}: {m.group()}: no heading with anchor "
                           f"#{m['anchor']} on {_rel(page)}")
    assert found, "no measurement address found: the pattern is broken"
    assert not bad, f"{len(bad)} measurement address(es) name nothing:\n" + "\n".join(bad)
