"""The safetensors branch of ComfyUI's ``comfy.utils.load_torch_file``, copied as it is at
Comfy-Org/ComfyUI commit b3be02d6e766a8d3743dcf99cc967118f3ec8e3e (comfy/utils.py; ComfyUI is
GPL-3.0), for tests/python/test_patch_safetensors.py: ComfyUI is not installable from a package
index. Left out: the ``comfy_aimdo`` branch (off unless ComfyUI runs with its aimdo allocator) and
the torch.load branch (not safetensors). ``DISABLE_MMAP`` is ComfyUI's ``--disable-mmap`` (off by
default). The calls, their arguments and the error handling are ComfyUI's, unchanged.
"""

import safetensors.torch  # ComfyUI imports the module and calls safetensors.safe_open through it
import torch

DISABLE_MMAP = False


def _invalid_safetensors_error(message, ckpt):
    return ValueError("{}\n\nFile path: {}\n\nThe safetensors file is corrupt or invalid. Make sure this is actually a safetensors file and not a ckpt or pt or other filetype.".format(message, ckpt))


def _incomplete_safetensors_error(message, ckpt):
    return ValueError("{}\n\nFile path: {}\n\nThe safetensors file is corrupt/incomplete. Check the file size and make sure you have copied/downloaded it correctly.".format(message, ckpt))


def load_torch_file(ckpt, safe_load=False, device=None, return_metadata=False):
    if device is None:
        device = torch.device("cpu")
    metadata = None
    if ckpt.lower().endswith(".safetensors") or ckpt.lower().endswith(".sft"):
        try:
            with safetensors.safe_open(ckpt, framework="pt", device=device.type) as f:
                sd = {}
                for k in f.keys():
                    tensor = f.get_tensor(k)
                    if DISABLE_MMAP:  # TODO: Not sure if this is the best way to bypass the mmap issues
                        tensor = tensor.to(device=device, copy=True)
                    sd[k] = tensor
                if return_metadata:
                    metadata = f.metadata()
        except Exception as e:
            if len(e.args) > 0:
                message = e.args[0]
                if "HeaderTooLarge" in message:
                    raise _invalid_safetensors_error(message, ckpt)
                if "MetadataIncompleteBuffer" in message:
                    raise _incomplete_safetensors_error(message, ckpt)
            raise e
    else:
        raise NotImplementedError("only the safetensors branch of load_torch_file is copied here")
    return (sd, metadata) if return_metadata else sd
