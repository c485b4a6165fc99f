"""scripts/check-layers.py: passes on this repository, and fails, naming file, line and layers, on
small fake trees with an upward include, a cycle between folders, a binding reaching into
another layer's internals, an unplaced folder or public header, and a stale exception."""

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check-layers.py"


def run(root):
    extra = [] if root == REPO else ["--no-exceptions"]
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), *extra], capture_output=True,
                          text=True, timeout=60)


def tree(tmp_path, files):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


CLEAN = {
    "include/pinload/error.h": "#pragma once\n",
    "include/pinload/env.h": "#pragma once\n#include <string>\n",
    "include/pinload/loader.h": '#pragma once\n#include "pinload/env.h"\n#include "pinload/error.h"\n',
    "src/base/log.h": '#pragma once\n#include "pinload/error.h"\n',
    "src/io/read_session.h": '#pragma once\n#include "base/log.h"\n#include "pinload/env.h"\n#include "third_party.h"\n',
    "src/io/read_session.cc": '#include "io/read_session.h"\n',
    "src/load/loader.cc": '#include "pinload/loader.h"\n#include "io/read_session.h"\n',
    "src/python/module.cc": '#include "pinload/loader.h"\n#include "module.h"\n',
    "src/python/module.h": "#pragma once\n",
}


def test_this_repository_passes():
    r = run(REPO)
    assert r.returncode == 0, r.stderr
    assert "check-layers: ok" in r.stdout


def test_a_clean_fake_tree_passes(tmp_path):
    r = run(tree(tmp_path, CLEAN))
    assert r.returncode == 0, r.stderr


def test_an_upward_include_fails_naming_file_line_and_layers(tmp_path):
    files = dict(CLEAN)
    files["src/io/read_session.h"] = '#pragma once\n#include "base/log.h"\n#include "pinload/loader.h"\n'
    r = run(tree(tmp_path, files))
    assert r.returncode == 1
    assert "src/io/read_session.h:3: io includes pinload/loader.h of load, a higher layer" in r.stderr, r.stderr


def test_a_cycle_between_folders_fails(tmp_path):
    files = dict(CLEAN)
    files["src/io/read_session.cc"] = '#include "io/read_session.h"\n#include "load/loader.h"\n'
    files["src/load/loader.h"] = '#pragma once\n#include "io/read_session.h"\n'
    r = run(tree(tmp_path, files))
    assert r.returncode == 1
    assert "src/io/read_session.cc:2: io includes load/loader.h of load, a higher layer" in r.stderr, r.stderr
    assert "include cycle between folders io, load" in r.stderr, r.stderr
    assert "load -> io (src/load/loader.cc:2 includes io/read_session.h)" in r.stderr, r.stderr


def test_peers_do_not_include_each_other(tmp_path):
    files = dict(CLEAN)
    files["src/cli/main.cc"] = '#include "python/module.h"\n'
    r = run(tree(tmp_path, files))
    assert r.returncode == 1
    assert "src/cli/main.cc:1: cli includes python/module.h of python, a folder of the same layer" in r.stderr


def test_bindings_include_public_headers_only(tmp_path):
    files = dict(CLEAN)
    files["src/python/module.cc"] = '#include "pinload/loader.h"\n#include "io/read_session.h"\n'
    r = run(tree(tmp_path, files))
    assert r.returncode == 1
    assert "src/python/module.cc:2: python includes io/read_session.h, internal to io" in r.stderr, r.stderr


def test_unplaced_folders_and_public_headers_fail(tmp_path):
    files = dict(CLEAN)
    files["src/newthing/a.cc"] = "int a;\n"
    files["include/pinload/newthing.h"] = "#pragma once\n"
    r = run(tree(tmp_path, files))
    assert r.returncode == 1
    assert "src/newthing/a.cc: folder 'newthing' is not in LAYERS" in r.stderr, r.stderr
    assert "include/pinload/newthing.h: public header not in PUBLIC_HEADERS" in r.stderr, r.stderr


PYTHON_CLEAN = {
    "python/pinload/__init__.py": "from .torch import load_file\n",
    "python/pinload/_helpers.py": "import os\n",
    "python/pinload/torch.py": "from . import _helpers\nfrom ._helpers import os\n\n\ndef load_file():\n"
                               "    from .numpy import load\n    return load\n",
    "python/pinload/numpy.py": "from typing import TYPE_CHECKING\nfrom . import _helpers\n"
                               "if TYPE_CHECKING:\n    from .torch import load_file\n\n\ndef load():\n"
                               "    from .torch import load_file\n    return load_file\n",
}


def test_python_imports_inside_functions_and_for_type_checking_pass(tmp_path):
    r = run(tree(tmp_path, {**CLEAN, **PYTHON_CLEAN}))
    assert r.returncode == 0, r.stderr


def test_a_python_import_cycle_fails_naming_both_imports(tmp_path):
    files = {**CLEAN, **PYTHON_CLEAN}
    files["python/pinload/_helpers.py"] = "import os\ntry:\n    from .torch import load_file\nexcept ImportError:\n    pass\n"
    r = run(tree(tmp_path, files))
    assert r.returncode == 1
    assert "import cycle between Python modules pinload._helpers, pinload.torch" in r.stderr, r.stderr
    assert "python/pinload/_helpers.py:3 imports pinload.torch" in r.stderr, r.stderr
    assert "python/pinload/torch.py:1 imports pinload._helpers" in r.stderr, r.stderr


def test_a_stale_exception_fails():
    module = load_script()
    module.EXCEPTIONS[("src/io/gone.cc", "load/gone.h")] = "fixed long ago"
    problems = module.check(REPO)
    assert any("src/io/gone.cc: the exception for its include of load/gone.h matches nothing" in p
               for p in problems), problems


def load_script():
    spec = importlib.util.spec_from_file_location("check_layers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_architecture_doc_lists_the_layers_in_order():
    doc = (REPO / "docs" / "architecture.md").read_text()
    table = doc[doc.index("| layer | folder and public headers |"):]
    positions = [table.find(f"`{layer}`") for group in load_script().LAYERS for layer in group]
    assert -1 not in positions, positions
    assert positions == sorted(positions), positions
