"""scripts/demo.py (the README's first command runs it): the seed article's three requests through
diffusers, stock beside pinload, each in a fresh process: a cold start (the page cache dropped per
file), a restart, and a switch back through ModelCache. Run here on the scaled-down SDXL."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_shows_the_three_requests_beside_stock_diffusers():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(ROOT / "python")) if p)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--scale", "small"], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"^SDXL pipeline: .*sdxl-base-small \([0-9.]+ GB of fp16 weights; small size", out, re.M), out
    number = r"[0-9]+\.[0-9]+"
    for request in ("cold start", "restart", r"switch SDXL -> FLUX -> back to SDXL"):
        assert re.search(rf"^{request} +{number} s +{number} s +{number} x", out, re.M), out
    assert re.search(r"^cold start .*\(page cache dropped\)", out, re.M), out
