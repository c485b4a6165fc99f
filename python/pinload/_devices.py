"""Device arguments, read one way: by the C++ parser (``parse_device_spec``, include/pinload/device.h).

"cpu" is host memory, "sim" pinload's CPU stand-in device, "cuda" / "cuda:N" a GPU; an int N means
"cuda:N" and a ``torch.device`` its string. No torch import here.
"""

from __future__ import annotations

from typing import Any

from . import _core


def device_text(device: Any) -> str:
    """The device string of a device argument (None: "cpu"). Raises TypeError for other types."""
    if device is None:
        return "cpu"
    if isinstance(device, bool):
        raise TypeError("device must be a str, int or torch.device, not bool")
    if isinstance(device, int):
        return f"cuda:{device}"
    if isinstance(device, str):
        return device
    if type(device).__module__ == "torch" and isinstance(getattr(device, "type", None), str):
        # torch.device: "cpu:0" is still the host.
        return "cpu" if device.type == "cpu" else str(device)
    raise TypeError(f"device must be a str, int or torch.device, not {type(device).__name__}")


def parse(device: Any) -> "_core.DeviceSpec":
    """The parsed device; raises pinload.InvalidArgumentError naming ``device`` for an unknown one."""
    return _core.parse_device_spec(device_text(device))


def key(device: Any) -> str:
    """The canonical pinload device of an argument: "cpu", "sim" or "cuda:N" ("cuda" is "cuda:0")."""
    return parse(device).name
