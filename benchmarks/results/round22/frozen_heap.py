"""Round 22: round 21's ``frozen_heap.py`` (its docstring says what it runs), rerun with the
freeze made in each forked worker (NOTE [ Frozen heap at fork ]), on Python 3.11-3.13:
``python frozen_heap.py ROUNDS OUT.json``. Only the report differs: its title, and a closing
sentence read from the run instead of one written for Python 3.11.
"""
import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location(
    "frozen_heap_round21",
    pathlib.Path(__file__).resolve().parents[1] / "round21" / "frozen_heap.py")
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)
_render21 = base.render


def render(doc):
    text = _render21(doc).replace("(round 21)", "(round 22)", 1)
    text = text[: text.rindex("\n\nOn Python 3.11 a worker")]  # round 21's closing sentence
    natural = doc["modes"]["natural"]
    fulls = sum(x["full_collections"] for runs in natural.values() for r in runs for x in r)
    if fulls == 0:
        closing = (f"No worker ran a full collection by itself in these reads (Python "
                   f"{doc['python']}), so their private memory at the end (the reference counts "
                   "of the rows read) compares like with like. The freeze matters where a full "
                   "collection runs: code calling `gc.collect()`, or Python 3.14's incremental "
                   "collector (not measured: no 3.14 interpreter on this machine).")
    else:
        closing = (f"Workers ran {fulls} full collections by themselves in these reads "
                   f"(Python {doc['python']}): the private memory at the end includes what they "
                   "copied.")
    return f"{text}\n\n{closing}\n"


base.render = render

if __name__ == "__main__":
    base.main()
