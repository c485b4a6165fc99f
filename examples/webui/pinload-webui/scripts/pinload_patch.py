"""pinload for AUTOMATIC1111's stable-diffusion-webui and Forge: an extension whose script routes the
webui's checkpoint reads through pinload.

    cp -r examples/webui/pinload-webui stable-diffusion-webui/extensions/   # pinload in the webui's venv

The webui imports each extension's scripts/ files at start-up, before it loads the first model. A1111
reads checkpoints with ``safetensors.torch.load_file`` (or ``safetensors.torch.load`` of the file's
bytes with "Disable memmapping for loading .safetensors files"), Forge's ``backend.utils.load_torch_file``
with ``safetensors.torch.load_file``: all through the module, so ``pinload.patch_safetensors()`` here routes them
(docs/python.md, "Libraries that call safetensors"). PINLOAD_WEBUI=0 turns it off.
"""

import logging
import os

PATCH = None
if os.environ.get("PINLOAD_WEBUI", "1") != "0":
    try:
        import pinload
    except ImportError as e:
        logging.warning("pinload-webui: pinload is not installed in this Python (%s); safetensors loads as before", e)
    else:
        PATCH = pinload.patch_safetensors()
