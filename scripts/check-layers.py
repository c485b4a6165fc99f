#!/usr/bin/env python3
"""Checks that the C++ sources include only downwards: no include from a lower layer to a higher
one, no include cycle between folders (docs/architecture.md, "Layers").

Usage: scripts/check-layers.py [--root DIR [--no-exceptions]]

Python: the package's modules (python/pinload) may not import each other in a circle at import
time: every import at a module's top level (not inside a function, not under TYPE_CHECKING) that
names another module of the package is an edge, and a cycle of them is reported with its imports.

Every `#include "..."` under src/ and include/ is read. A file's layer is its folder under src/
(src/io/read_session.cc: io), or for a public header include/pinload/X.h the layer named in
PUBLIC_HEADERS. A file may include its own layer and the layers below it; folders of one layer
group (LAYERS) do not include each other. The bindings (BINDINGS) include public headers only,
besides their own files. Exits 1 naming file, line and both layers of every violation, 0 when
there is none. Needs nothing but Python 3.
"""

import argparse
import ast
import os
import re
import sys
from pathlib import Path

# The layers, lowest first, in the order data flows: bytes leave storage through the OS seam or a
# remote client, are read through a file's byte source, are described by the format, land in pool
# memory through io's chunk executor, go on to a device, are converted, and are handed out by the
# loader; tools and adapters sit on top. Each entry is a group of folders under src/ of the same rank.
LAYERS = [
    ("base",),              # errors, logging, sizes
    ("os",),                # Env, the one OS seam; the one retried read (os/read_full.h)
    ("remote",),            # s3:// and http(s):// objects over libcurl: the network's seam
    ("source",),            # the bytes of one file: local, mapped or remote (byte_source.h)
    ("format",),            # dtypes, the safetensors header, checkpoint resolution
    ("memory",),            # host slabs, the two-level pool, NUMA, memory limits
    ("io",),                # file identity, read plans and templates, the chunk executor
    ("device",),            # the device seam, its backends, the copy engine
    ("convert",),           # FP8 copies of checkpoints; the dtype options of a load
    ("store",),             # the node store's client and server (include/pinload/store.h)
    ("load",),              # the loader, state dicts, cache, prefetch, batch, shards, manifests
    ("trace",),             # recording and replaying other loaders' reads
    ("torch", "python", "cli"),  # adapters
]

# include/pinload/X.h: the layer of the folder that implements it.
PUBLIC_HEADERS = {
    "error.h": "base",
    "size.h": "base",
    "env.h": "os",
    "remote.h": "remote",
    "dtype.h": "format",
    "safetensors.h": "format",
    "checkpoint.h": "format",
    "host_memory.h": "memory",
    "pool.h": "memory",
    "numa.h": "memory",
    "memory_limit.h": "memory",
    "file_identity.h": "source",
    "byte_source.h": "source",
    "io_template.h": "io",
    "read_options.h": "io",
    "read_plan.h": "io",
    "device.h": "device",
    "copy_engine.h": "device",
    "convert.h": "convert",
    "store.h": "store",
    "state_dict.h": "load",
    "manifest.h": "load",
    "loader.h": "load",
    "batch.h": "load",
    "shard.h": "load",
    "prefetch.h": "load",
    "model_cache.h": "load",
    "session.h": "load",
    "request.h": "load",
    "torch.h": "torch",
}

# Folders that only convert types for another language: they include public headers and their
# own files, never another layer's internals.
BINDINGS = {"python", "torch"}

# Known violations, each with the reason it stands: (including file, included path) -> why.
# An exception that no longer matches an include is itself an error, so none outlives its fix.
EXCEPTIONS = {
    ("src/python/conversions.cc", "format/dtype_convert.h"):
        "convert_bytes, a test hook, runs the internal element conversions on bytes from Python; "
        "it goes once convert.h has a public way to convert a span",
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
SOURCE_SUFFIXES = {".h", ".hpp", ".cc", ".cpp", ".cu", ".cuh"}


def rank_of():
    ranks, groups = {}, {}
    for i, group in enumerate(LAYERS):
        for layer in group:
            ranks[layer] = i
            groups[layer] = group
    return ranks, groups


def layer_of(root, path, problems):
    """The layer of a file under root (a Path), or None after recording why there is none."""
    rel = path.relative_to(root)
    parts = rel.parts
    if parts[0] == "include":
        if len(parts) == 3 and parts[1] == "pinload" and parts[2] in PUBLIC_HEADERS:
            return PUBLIC_HEADERS[parts[2]]
        problems.append(f"{rel}: public header not in PUBLIC_HEADERS of scripts/check-layers.py: give it a layer")
        return None
    if len(parts) < 3:
        problems.append(f"{rel}: a file directly in src/: put it in a layer's folder")
        return None
    return parts[1]


def resolve(root, including, target):
    """The file `#include "target"` in `including` names, or None (then not ours: skipped)."""
    if target.startswith("pinload/"):
        candidate = root / "include" / target
        return candidate if candidate.is_file() else None
    for base in (including.parent, root / "src"):
        candidate = base / target
        if candidate.is_file():
            return Path(os.path.normpath(candidate))
    return None


def find_cycles(edges):
    """Strongly connected components of more than one folder (Tarjan), each as a sorted list."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]
    nodes = sorted({a for a, _ in edges} | {b for _, b in edges})
    succ = {n: sorted({b for a, b in edges if a == n}) for n in nodes}

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for n in nodes:
        if n not in index:
            visit(n)
    return out


PYTHON_PACKAGE = Path("python") / "pinload"


def _module_name(package_dir, path):
    rel = path.relative_to(package_dir.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _top_level_imports(tree):
    """The import statements a module runs when it is imported: its top level, and the bodies of
    top-level try/if/with blocks, except under `if TYPE_CHECKING:`."""
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            test = node.test
            if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
                pending.extend(node.orelse)
                continue
            pending.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            pending.extend(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
        elif isinstance(node, ast.With):
            pending.extend(node.body)


def check_python_imports(root):
    """Import cycles between the Python package's modules, as problems (a list of str)."""
    package_dir = Path(root) / PYTHON_PACKAGE
    if not package_dir.is_dir():
        return []
    modules = {_module_name(package_dir, p): p for p in sorted(package_dir.rglob("*.py"))}
    edges = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        try:
            tree = ast.parse(path.read_text(errors="replace"), str(path))
        except SyntaxError as e:
            return [f"{path.relative_to(root)}: cannot parse: {e}"]
        for node in _top_level_imports(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = here
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                if node.level == 0:
                    base = node.module or ""
                elif node.module:
                    base = f"{base}.{node.module}"
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                # A name imported from a package is its module where there is one; the package's
                # own __init__ is not an edge (Python runs it before any of its modules).
                if target in modules and target != name and not name.startswith(target + "."):
                    where = f"{path.relative_to(root).as_posix()}:{node.lineno}"
                    edges.setdefault((name, target), f"{where} imports {target}")
    problems = []
    for cycle in find_cycles(set(edges)):
        members = set(cycle)
        links = [f"{a} -> {b} ({how})" for (a, b), how in sorted(edges.items()) if a in members and b in members]
        problems.append(f"import cycle between Python modules {', '.join(cycle)}: " + "; ".join(links))
    return problems


def check(root, exceptions=None):
    """Returns the list of problems found under root (a Path); `exceptions`: EXCEPTIONS by default."""
    exceptions = EXCEPTIONS if exceptions is None else exceptions
    root = Path(root)
    ranks, groups = rank_of()
    problems = []
    edges = {}  # (from layer, to layer) -> first "file:line includes X" seen
    used_exceptions = set()
    files = sorted(p for d in ("src", "include") if (root / d).is_dir()
                   for p in (root / d).rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES)
    for path in files:
        rel = path.relative_to(root).as_posix()
        src_layer = layer_of(root, path, problems)
        if src_layer is None:
            continue
        if src_layer not in ranks:
            problems.append(f"{rel}: folder '{src_layer}' is not in LAYERS of scripts/check-layers.py: give it a layer")
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            target = m.group(1)
            found = resolve(root, path, target)
            if found is None:
                continue  # a system or third-party header spelled with quotes
            dst_layer = layer_of(root, found, problems)
            if dst_layer is None or dst_layer == src_layer:
                continue
            where = f"{rel}:{lineno}"
            if dst_layer not in ranks:
                problems.append(f"{where}: includes {target}, whose folder '{dst_layer}' is not in LAYERS")
                continue
            edges.setdefault((src_layer, dst_layer), f"{where} includes {target}")
            key = (rel, target)
            if key in exceptions:
                used_exceptions.add(key)
                continue
            if ranks[dst_layer] > ranks[src_layer]:
                problems.append(f"{where}: {src_layer} includes {target} of {dst_layer}, a higher layer "
                                f"({' < '.join(['/'.join(g) for g in LAYERS[ranks[src_layer]:ranks[dst_layer] + 1]])})")
            elif ranks[dst_layer] == ranks[src_layer]:
                problems.append(f"{where}: {src_layer} includes {target} of {dst_layer}, a folder of the same layer "
                                f"({'/'.join(groups[src_layer])}): peers do not include each other")
            elif src_layer in BINDINGS and not target.startswith("pinload/"):
                problems.append(f"{where}: {src_layer} includes {target}, internal to {dst_layer}: "
                                f"bindings include public headers (pinload/*.h) only")
    for cycle in find_cycles(set(edges)):
        members = set(cycle)
        links = [f"{a} -> {b} ({how})" for (a, b), how in sorted(edges.items()) if a in members and b in members]
        problems.append(f"include cycle between folders {', '.join(cycle)}: " + "; ".join(links))
    problems.extend(check_python_imports(root))
    for key in sorted(set(exceptions) - used_exceptions):
        problems.append(f"{key[0]}: the exception for its include of {key[1]} matches nothing: remove it from "
                        f"EXCEPTIONS in scripts/check-layers.py")
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parent.parent),
                        help="the tree to check (default: this repository)")
    parser.add_argument("--no-exceptions", action="store_true",
                        help="apply none of EXCEPTIONS (for a tree other than this repository)")
    args = parser.parse_args()
    problems = check(Path(args.root), {} if args.no_exceptions else None)
    for p in problems:
        print(f"check-layers: {p}", file=sys.stderr)
    if problems:
        print(f"check-layers: {len(problems)} problem(s); the layers are in scripts/check-layers.py "
              f"and docs/architecture.md", file=sys.stderr)
        return 1
    print("check-layers: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
