"""The documentation cannot rot: the site builds strictly, the README's links and code are
real, the commands it shows parse, and the examples run.

Rules the pages follow (docs/ and README.md):
- a ```python block in the README is a verbatim piece of a file under examples/, which a test
  here runs; the site includes those files whole (`--8<--`, checked by the build);
- a ```bash block holds exact commands: `specdec ...` must parse with today's flags,
  `python PATH` and `make TARGET` must name a file and a Makefile target that exist (plain ```
  blocks are for synopses with placeholders);
- every benchmark record (docs/results/*.json) names a command that exists the same way.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import save_loaded, tiny_llama

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BENCH_DRIVERS = sorted(p for p in (ROOT / "scripts" / "bench").rglob("*.py") if p.name != "served.py")


def fenced(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", path.read_text(), flags=re.MULTILINE | re.DOTALL)


def commands(block: str) -> list[str]:
    """The command lines of a bash block: continuations joined, comments and blank lines left out."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split(" #")[0].strip() for line in joined.splitlines()
            if line.strip() and not line.startswith("#")]


def check_command(line: str) -> None:
    argv = shlex.split(line)
    if argv[0] == "specdec":
        from specdec.cli import build_parser

        try:
            build_parser().parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"does not parse: {line}")
    elif argv[0] == "python" and argv[1] != "-m":
        assert (ROOT / argv[1]).is_file(), line
    elif argv[0] == "python":
        __import__(argv[2])
    elif argv[0] == "make":
        assert re.search(rf"^{argv[1]}:", (ROOT / "Makefile").read_text(), re.MULTILINE), line
    else:
        pytest.fail(f"a bash block runs something the docs test does not know: {line}")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_bash_blocks_hold_commands_that_exist(page):
    for block in fenced(page, "bash"):
        for line in commands(block):
            check_command(line)


@pytest.mark.parametrize("record", sorted((ROOT / "docs" / "results").glob("*.json")), ids=lambda p: p.stem)
def test_benchmark_records_name_their_machine_and_a_command_that_exists(record):
    data = json.loads(record.read_text())
    assert data["machine"]["cpu"] and data["machine"]["threads"] and data["commit"] and data["date"]
    assert data.get("rows") or data.get("raw")
    command = data["command"]
    synopsis = "[" in command or "|" in command  # options shown as a synopsis: check the program alone
    check_command(" ".join(command.split()[:2]) if synopsis else command)


def test_readme_python_is_a_verbatim_piece_of_an_example():
    examples = [p.read_text() for p in (ROOT / "examples").glob("*.py")]
    blocks = fenced(ROOT / "README.md", "python")
    assert blocks
    for block in blocks:
        assert any(block.strip() in text for text in examples), block


def test_readme_links_reach_pages_and_headings():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page, anchor in re.findall(r"\]\((docs/[\w-]+\.md)(?:#([\w-]+))?\)", readme):
        assert (ROOT / page).is_file(), page
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / page).read_text(), re.MULTILINE)
            assert anchor in {slug(h) for h in headings}, (page, anchor)


def slug(heading: str) -> str:
    """MkDocs' heading ids: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))


@pytest.mark.parametrize("driver", BENCH_DRIVERS, ids=lambda p: p.stem)
def test_every_bench_driver_has_help(driver, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(driver), "--help"])
    monkeypatch.syspath_prepend(str(driver.parent))  # its helpers (served.py)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(driver), run_name="__main__")
    assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out


def test_the_site_builds_strictly(tmp_path):
    """`make docs`: a broken link or anchor, a page left out of the nav, a results file no page
    shows, a missing example or a hook failure is an error."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install 'specdec[docs]'")
    pytest.importorskip("material", reason="mkdocs-material is not installed: pip install 'specdec[docs]'")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                          "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    reference = (tmp_path / "site" / "configuration" / "index.html").read_text()
    assert "max_prefill_tokens" in reference and "verify_strategy" in reference  # generated from the code
    record = json.loads((ROOT / "docs" / "results" / "llamacpp.json").read_text())
    plain_rate = record["rows"][0][record["columns"].index("tok/s")]
    # rendered from a record
    assert plain_rate in (tmp_path / "site" / "benchmarks" / "index.html").read_text()


def test_the_tool_call_example_calls_a_tool_on_a_real_server(tmp_path):
    from served_helpers import ServerProcess

    model_dir = save_loaded(tiny_llama(0, max_positions=2048), tmp_path / "tiny")
    server = ServerProcess(model_dir, "--drafter", "ngram:min=1")
    try:
        run = subprocess.run([sys.executable, str(ROOT / "examples" / "tool_call_client.py"),
                              server.url + "/v1"],
                             capture_output=True, text=True, env=_env(), timeout=300)
    finally:
        server.close()
    assert run.returncode == 0, run.stderr[-3000:]
    name = run.stdout.split()[0]
    tools = json.loads((ROOT / "examples" / "tools.json").read_text())
    assert name in {tool["function"]["name"] for tool in tools}
    assert "forced" in run.stdout  # the spec_decode object came back


@pytest.mark.slow
def test_the_quickstart_example_runs_on_the_embedded_model():
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True,
                         text=True, env=_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tokens_per_second" in run.stdout  # the stats summary


def _env() -> dict:
    src = str(ROOT / "src")
    return {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "NO_MKDOCS_2_WARNING": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_a_recorded_bench_run_renders_as_a_table(tmp_path, monkeypatch):
    """record.py's rows from a `specdec bench` results.json, and a script's raw JSON, as the
    benchmarks page shows them."""
    record = runpy.run_path(str(ROOT / "scripts" / "bench" / "record.py"))
    hooks = runpy.run_path(str(ROOT / "scripts" / "docs" / "hooks.py"))
    entry = {"per_category": {"math": {"speedup": 1.5}}, "speedup": 1.5, "mean_accepted_length": 2.0,
             "tokens_per_second": 30.0, "exact_match": "4/4", "valid_calls": None}
    peer = {**entry, "mean_accepted_length": None, "exact_match": "1/4"}
    columns, rows = record["bench_rows"]({"methods": {"ngram": entry}, "peers": {"llamacpp": peer}})
    assert columns == ["Method", "math", "Overall", "τ", "tok/s", "Exact match"]
    assert rows == [["`ngram`", "1.50x", "1.50x", "2.00", "30.0", "4/4"],
                    ["`llamacpp` (peer)", "1.50x", "1.50x", None, "30.0", "1/4"]]
    own = {"columns": ["n", "ms"], "rows": [[1, 9.5]], "threads": 4, "extra": 1}
    assert record["script_table"](own) == ({"columns": ["n", "ms"], "rows": [[1, 9.5]]}, 4)
    assert record["script_table"]({"itl": 3}) == ({}, None)
    base = {"title": "T", "command": "specdec bench", "machine": {"cpu": "C", "threads": 2}, "commit": "abc",
            "date": "2026-01-01"}
    (tmp_path / "bench.json").write_text(json.dumps({**base, "columns": columns, "rows": rows}))
    (tmp_path / "script.json").write_text(json.dumps({**base, "raw": {"itl": {"p99": 7}, "ok": True}}))
    render = hooks["results_table"]
    monkeypatch.setitem(render.__globals__, "RESULTS_DIR", tmp_path)
    assert "| `llamacpp` (peer) | 1.50x | 1.50x | – | 30.0 | 1/4 |" in render("bench")
    assert "CPU: C; threads: 2; commit `abc`; date 2026-01-01." in render("bench")
    assert "| itl.p99 | 7 |" in render("script")
    with pytest.raises(FileNotFoundError):
        render("missing")


def test_the_native_module_map_lists_the_tree():
    """docs/architecture.md's module map of the native backend names every file, and only those."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("<!-- native-module-map -->")[1].split("<!-- /native-module-map -->")[0]
    mapped = re.findall(r"^\| `([\w/]+\.py)` \| .+ \|$", table, flags=re.MULTILINE)
    native = ROOT / "src" / "specdec" / "backends" / "native"
    tree = sorted(str(p.relative_to(native)) for p in native.rglob("*.py"))
    assert sorted(mapped) == tree
    assert len(mapped) == len(set(mapped)), "a file mapped twice"
