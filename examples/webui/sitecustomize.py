"""pinload for any Python program that reads checkpoints through the safetensors module (A1111, Forge,
scripts): Python imports ``sitecustomize`` at start-up, so with this folder first on PYTHONPATH,

    PYTHONPATH=/path/to/pinload/examples/webui ./webui.sh

``pinload.patch_safetensors()`` is in place before any module of the program is imported (Note
[Patching safetensors' module attributes] in pinload/safetensors_hook.py). It imports torch at
start-up (safetensors.torch needs it). Only where PINLOAD_PATCH_SAFETENSORS is not "0"; a Python
without pinload starts as before.
"""

import os

if os.environ.get("PINLOAD_PATCH_SAFETENSORS", "1") != "0":
    try:
        import pinload
    except ImportError:
        pinload = None
    if pinload is not None:
        PINLOAD_PATCH = pinload.patch_safetensors()
