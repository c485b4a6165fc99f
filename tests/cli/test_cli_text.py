"""What `pinload` prints for people: every subcommand's --help names its options' values
(SIZE, PID, DIR, 1..1024, auto|on|off), never CLI11's raw types (TEXT, UINT, INT:INT in [1 - 1073741824],
TEXT:{a,b}); `inspect` prints sizes in GB as `load` does, and --json keeps the exact bytes."""

import json
import re

import pytest
import stfiles

# CLI11's own type names and validator texts, shown where an option has no type_name.
RAW = re.compile(r"\b(TEXT|UINT|INT|FLOAT|NUMBER|BOOLEAN|ENUM)\b|:\{|in \[")


def subcommands(run_pinload, *path):
    out = run_pinload(*path, "--help").stdout
    assert "Subcommands:" in out or path, out
    section = out.split("Subcommands:", 1)[1] if "Subcommands:" in out else ""
    names = []
    for line in section.splitlines():
        m = re.match(r"^  ([a-z][a-z-]*)\s", line)
        if m:
            names.append(m.group(1))
        elif names and not line.startswith(" "):
            break
    return names


def every_subcommand(run_pinload):
    """[("load",), ("store", "serve"), ...]: the CLI11 subcommands, nested ones too. `encoder`
    hands its arguments to the Python package (argparse: docs/encoder.md) and is left out."""
    found = []
    for name in subcommands(run_pinload):
        if name == "encoder":
            continue
        nested = subcommands(run_pinload, name)
        found += [(name, n) for n in nested] if nested else [(name,)]
    return found


def test_every_subcommand_names_its_option_values(run_pinload):
    commands = every_subcommand(run_pinload)
    assert {("warm",), ("agent",), ("load",), ("store", "serve")} <= set(commands), commands
    bad = []
    for command in commands:
        r = run_pinload(*command, "--help")
        assert r.returncode == 0, r
        for line in r.stdout.splitlines():
            if re.match(r"^\s+(-|[A-Z])", line) and RAW.search(line):
                bad.append(f"pinload {' '.join(command)}: {line.strip()}")
    assert not bad, "raw CLI11 types in --help:\n" + "\n".join(bad)


def test_warm_and_agent_help_read_as_the_readme(run_pinload):
    warm = run_pinload("warm", "--help").stdout
    for option in ("--template TEMPLATE", "--budget SIZE", "--follow PID", "--cgroup DIR", "--threads 1..1024=8"):
        assert option in warm, warm
    agent = run_pinload("agent", "--help").stdout
    for option in ("--root DIR", "--templates DIR", "--idle-ms MS 1..3600000=5000", "--threads 1..1024=8"):
        assert option in agent, agent
    # The ranges are still checked, and named in the usage error.
    r = run_pinload("warm", "--follow", "0", "--template", "t")
    assert r.returncode == 2 and "--follow" in r.stderr and "1..1073741824" in r.stderr, r


def test_inspect_prints_gb_as_load_does_and_json_keeps_bytes(tmp_path, run_pinload):
    path = tmp_path / "t.safetensors"
    stfiles.write_raw(path, [("big", "U8", [3, 1_000_000], bytes(3_000_000)), ("b", "BF16", [4], bytes(8))])
    _, n = stfiles.read_header(path)
    out = run_pinload("inspect", path)
    assert out.returncode == 0, out
    assert f"{path}: 2 tensors, 0.003 GB of data, header {n} bytes" in out.stdout, out.stdout
    assert out.stdout.rstrip().endswith("total: 2 tensors, 0.003 GB in 1 file(s)"), out.stdout
    assert "data bytes" not in out.stdout and "3000008" not in out.stdout
    assert f"  big\tU8\t[3,1000000]\t3000000 B\t[{8 + n}, {8 + n + 3_000_000})" in out.stdout  # each tensor: exact
    load = run_pinload("load", "--no-progress", path)
    assert re.search(r": 2 tensors, 0\.003 GB in ", load.stderr), load
    doc = json.loads(run_pinload("inspect", "--json", path).stdout)
    assert doc["total_bytes"] == 3_000_008
    assert [t["bytes"] for t in doc["files"][0]["tensors"]] == [3_000_000, 8]
