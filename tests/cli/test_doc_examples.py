"""The README's and docs' example commands on the default models run as written.

Every command line of a ```sh block in README.md or docs/*.md that names a default model
(flux-dev-small, sdxl-base-small) is run, on models that scripts/gen_checkpoints.py writes here
(--scale small: the defaults, weight-like values), with `build/...` replaced by this build's
programs, ~/.cache/pinload/models by the test's models and /tmp by the test's folder. Each must
exit 0 with the output its command prints on success; `pinload convert` among them (it refused
the random-bytes models: "element ... is infinite"), and the README's own block must be found.

Every ```python block of README.md and of docs/python.md, cache.md, lora.md and fp8.md runs too, as
written, in a fresh `python3` with this build's module (PYTHONPATH=build/python:python) and
PINLOAD_MODELS set to the test's models (/tmp replaced by the test's folder), and must exit 0; a
block that cannot run here (a GPU, a server, a UI) has a `<!-- not run: REASON -->` line right
above its fence, and is skipped with that reason. So each block either runs or says why not.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DEFAULTS = re.compile(r"\b(flux-dev-small|sdxl-base-small)\b")
# A command line starts with one of these (other lines of a block are its output).
PROGRAMS = ("build/", "scripts/", "M=", "pinload ", "python3 ")


def examples():
    """(doc, line number, [command lines of the block]) for each block that names a default model.
    Assignments (M=...) are kept with the block's commands so that each runs as written."""
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() != "```sh":
                i += 1
                continue
            start, block, i = i + 1, [], i + 1
            while i < len(lines) and lines[i].strip() != "```":
                line = lines[i]
                while line.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line[:-1] + " " + lines[i].strip()
                if line.startswith(PROGRAMS):
                    block.append(line)
                i += 1
            if any(DEFAULTS.search(c) for c in block):
                found.append((doc.relative_to(REPO), start, block))
    return found


EXAMPLES = examples()


def test_the_readme_has_its_examples():
    readme = [c for doc, _, block in EXAMPLES if str(doc) == "README.md" for c in block]
    for command in ("pinload inspect", "pinload load", "pinload convert", "pinload manifest"):
        assert any(command in c for c in readme), f"README.md: no {command} example on the default models"


@pytest.fixture(scope="module")
def models():
    """The default models, written by the generator (to /dev/shm where it has room)."""
    pytest.importorskip("diffusers")  # the SDXL pipeline's classes
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    base = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > (4 << 30) else None
    out = Path(tempfile.mkdtemp(prefix="pinload-doc-examples-", dir=base))
    try:
        done = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_checkpoints.py"), "--scale", "small",
                               "--out", str(out / "models")], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        yield out
    finally:
        shutil.rmtree(out, ignore_errors=True)


# What each program prints on success (stdout and stderr together).
SANE = [
    (r"pinload inspect\b", r"^total: [1-9]\d* tensors, \d+\.\d{3} GB in [1-9]\d* file\(s\)$"),
    (r"pinload load\b", r": [1-9]\d* tensors, \d+\.\d{3} GB in \d+\.\d+ s = "),
    (r"pinload convert\b", r": [1-9]\d* files, [1-9]\d* tensors quantised, \d+ kept"),
    (r"pinload-bench\b.*--phases switch", r"^\[switch\] cold load .* 0 preads"),
]


def program_paths(pinload_bin):
    build = Path(pinload_bin).parent
    return {"build/pinload": pinload_bin, "build/bench/pinload-bench": str(build / "bench" / "pinload-bench")}


@pytest.mark.parametrize("doc,line,block", EXAMPLES, ids=[f"{d}:{n}" for d, n, _ in EXAMPLES])
def test_example_runs_on_the_default_models(doc, line, block, models, pinload_bin):
    work = models / "work" / f"{str(doc).replace('/', '_')}-{line}"
    work.mkdir(parents=True)
    programs = program_paths(pinload_bin)
    env = {**os.environ, "PINLOAD_MODELS": str(models / "models"), "HOME": str(models / "home"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "python"), os.environ.get("PYTHONPATH")]))}
    (models / "home" / ".cache" / "pinload").mkdir(parents=True, exist_ok=True)
    home_models = models / "home" / ".cache" / "pinload" / "models"
    if not home_models.exists():
        home_models.symlink_to(models / "models")
    prelude = []
    for command in block:
        text = command.replace("/tmp/", f"{work}/")
        for name, path in programs.items():
            text = re.sub(rf"(?<![\w/]){re.escape(name)}\b", shlex.quote(path), text)
        if re.match(r"^[A-Za-z_]\w*=", text) and " " not in text.split("#")[0].strip():
            prelude.append(text)  # an assignment: kept for the commands after it
            continue
        if "pinload-bench" in command and not os.access(programs["build/bench/pinload-bench"], os.X_OK):
            pytest.skip(f"{doc}:{line}: no pinload-bench in this build (PINLOAD_BUILD_BENCH=OFF)")
        script = "set -euo pipefail\n" + "\n".join(prelude + [text])
        done = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
        out = done.stdout + done.stderr
        assert done.returncode == 0, f"{doc}:{line}: `{command}` exited {done.returncode}:\n{out[-3000:]}"
        if " -o " not in command:
            assert out.strip(), f"{doc}:{line}: `{command}` printed nothing"
        for program, sane in SANE:
            if re.search(program, command):
                assert re.search(sane, out, re.M), f"{doc}:{line}: `{command}` printed:\n{out[-3000:]}"
        if " -o " in command:  # the file it writes is there and not empty
            written = Path(text.split(" -o ")[1].split()[0])
            assert written.is_file() and written.stat().st_size > 0, command


# The pages whose Python blocks are run (the README's and the Python API's).
PYTHON_DOCS = [REPO / "README.md", *(REPO / "docs" / f"{name}.md" for name in ("python", "cache", "lora", "fp8"))]
NOT_RUN = re.compile(r"^<!-- not run: (\S.*?) -->$")


def python_examples():
    """(doc, line number, code, reason it is not run or None) for each ```python block."""
    found = []
    for doc in PYTHON_DOCS:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != "```python":
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            marker = NOT_RUN.match(lines[i - 1].strip()) if i > 0 else None
            assert marker or "not run" not in lines[i - 1], f"{doc}:{i + 1}: write `<!-- not run: REASON -->`"
            found.append((doc.relative_to(REPO), i + 1, "\n".join(lines[i + 1:end]) + "\n",
                          marker.group(1) if marker else None))
    return found


PYTHON_EXAMPLES = python_examples()


def test_the_python_pages_have_runnable_examples():
    """The README's block and most of the API pages' run (a page cannot mark them all away)."""
    run = [(str(doc), line) for doc, line, _, why in PYTHON_EXAMPLES if why is None]
    assert any(doc == "README.md" for doc, _ in run), "README.md: its Python block is not run"
    for doc in PYTHON_DOCS[1:]:
        assert any(d == str(doc.relative_to(REPO)) for d, _ in run), f"{doc}: no Python block is run"
    lora = [code for doc, _, code, why in PYTHON_EXAMPLES if str(doc) == "docs/lora.md" and why is None]
    assert any("LoraFuser(" in code and "verify_base=False" not in code for code in lora), \
        "docs/lora.md: no LoraFuser example with its default verify_base is run"


@pytest.fixture(scope="module")
def python_runs(models, pinload_bin):
    """Every runnable Python block, run two at a time (each in its own process and folder):
    (doc, line) -> CompletedProcess."""
    build = Path(pinload_bin).parent
    env = {**os.environ, "PINLOAD_MODELS": str(models / "models"), "HOME": str(models / "home"),
           "PYTHONPATH": os.pathsep.join([str(build / "python"), str(REPO / "python")])}

    def run(example):
        doc, line, code, _ = example
        work = models / "work" / f"py-{str(doc).replace('/', '_')}-{line}"
        work.mkdir(parents=True)
        return subprocess.run([sys.executable, "-c", code.replace("/tmp/", f"{work}/")], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)

    runnable = [e for e in PYTHON_EXAMPLES if e[3] is None]
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(run, runnable))
    return {(str(doc), line): d for (doc, line, _, _), d in zip(runnable, done)}


@pytest.mark.parametrize("doc,line,code,not_run", PYTHON_EXAMPLES, ids=[f"{d}:{n}" for d, n, _, _ in PYTHON_EXAMPLES])
def test_python_example_runs_on_the_default_models(doc, line, code, not_run, request):
    if not_run is not None:
        pytest.skip(f"{doc}:{line}: not run: {not_run}")
    done = request.getfixturevalue("python_runs")[(str(doc), line)]
    assert done.returncode == 0, f"{doc}:{line}: exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"
