"""pinload for ComfyUI: a custom-node package that routes ComfyUI's checkpoint reads through pinload.

    cp -r examples/comfyui/pinload_loader ComfyUI/custom_nodes/      # pinload installed in ComfyUI's Python

ComfyUI imports every package in custom_nodes/ at start-up, before a workflow loads a model. This
one adds no node: importing it calls ``pinload.patch_safetensors()``, after which
``comfy.utils.load_torch_file`` (checkpoints, LoRAs, VAEs, text encoders, ControlNets: it calls
``safetensors.safe_open`` through the module) reads through pinload's parallel reader into its
pooled memory. What pinload does not serve goes to safetensors unchanged (docs/python.md,
"Libraries that call safetensors"). PINLOAD_COMFY=0 turns it off; PINLOAD_COMFY_THREADS sets the
reader threads (default: pinload's).
"""

import logging
import os

NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}

PATCH = None
if os.environ.get("PINLOAD_COMFY", "1") != "0":
    try:
        import pinload
    except ImportError as e:
        logging.warning("pinload_loader: pinload is not installed in this Python (%s); safetensors loads as before", e)
    else:
        options = {}
        if os.environ.get("PINLOAD_COMFY_THREADS"):
            options["threads"] = int(os.environ["PINLOAD_COMFY_THREADS"])
        PATCH = pinload.patch_safetensors(**options)
        logging.info("pinload_loader: safetensors reads go through pinload %s", pinload.__version__)
