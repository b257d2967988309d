"""Parsing of where weights go (`--device-map`, `--max-memory`): the config validates them once, at load.

accelerate's strategies or a JSON {module: device}; sizes are bytes or accelerate's units (10GiB, 500MB).
"""

from __future__ import annotations

import json

from paged_backend.errors import InvalidRequest

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def parse_device_map(value: str | dict | None) -> str | dict | None:
    """`--device-map`: one of accelerate's strategies or a JSON object {module name: device}.

    >>> parse_device_map('{"model.layers.1": "disk", "": "cpu"}')
    {'model.layers.1': 'disk', '': 'cpu'}
    """
    if value is None or isinstance(value, dict):
        return value
    if value in DEVICE_MAP_STRATEGIES:
        return value
    try:
        mapping = json.loads(value)
    except json.JSONDecodeError:
        mapping = None
    if not isinstance(mapping, dict):
        raise InvalidRequest(
            f"device map {value!r} is neither one of {', '.join(DEVICE_MAP_STRATEGIES)} nor a JSON object of "
            f'module name -> device (for example {{"model.layers.3": "disk", "": "cpu"}})'
        )
    return mapping


def parse_max_memory(value: str | dict | None) -> dict | None:
    """`--max-memory`: `DEVICE=SIZE,...` (accelerate's sizes: 10GiB, 500MB, or bytes) or a JSON object.

    >>> parse_max_memory("0=20GiB,cpu=64GiB")
    {0: '20GiB', 'cpu': '64GiB'}
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as error:
                raise InvalidRequest(f"--max-memory is not valid JSON: {error}") from error
        else:
            pairs = [part.split("=", 1) for part in text.split(",") if part.strip()]
            if not pairs or any(len(pair) != 2 for pair in pairs):
                raise InvalidRequest(
                    f"--max-memory {value!r} must read DEVICE=SIZE[,DEVICE=SIZE], e.g. 0=20GiB,cpu=60GiB"
                )
            value = {device.strip(): size.strip() for device, size in pairs}
    if not isinstance(value, dict):
        raise InvalidRequest("max_memory must map devices (0, 1, 'cpu', 'disk') to sizes")
    return {_device_key(device): _size(size) for device, size in value.items()}


def _device_key(device) -> int | str:
    text = str(device)
    if text.isdigit():
        return int(text)
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    if text in ("cpu", "disk", "mps"):
        return text
    raise InvalidRequest(f"max_memory device {device!r} must be a GPU index (0, 1, ...), 'cpu', 'disk' or 'mps'")


def _size(size) -> int | str:
    if isinstance(size, int) or (isinstance(size, str) and size.isdigit()):
        return int(size)
    from accelerate.utils import convert_file_size_to_int

    try:
        convert_file_size_to_int(size)
    except ValueError as error:
        raise InvalidRequest(
            f"max_memory size {size!r} is not a size (use bytes, or units like 10GiB, 500MB)"
        ) from error
    return size
