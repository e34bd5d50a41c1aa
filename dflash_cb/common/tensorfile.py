"""Safetensors files written with Python's own file I/O, so that a failed write is a real ``OSError``.

``safetensors.torch.save_file`` writes from Rust and reports a full disk (or ``ulimit -f``) as its
own error type, with the OS error only in the message text. Here the bytes go through ``open`` and
``write``: the error carries its errno and, inside ``fileio.atomic_path``, names the destination.
The file is byte for byte what ``save_file`` writes (``tests/cache/test_tensorfile.py`` checks it against
safetensors itself): the header's layout (the tensors' order and dtype names) is safetensors' own,
asked of it for empty tensors of the same names and dtypes; the data follows in that order,
straight from the tensors' memory (no second copy of a multi-GB head). Little-endian hosts only,
like the rest of the package's tensor files.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping

import torch


def _layout(tensors: Mapping[str, torch.Tensor]) -> dict:
    """safetensors' header for these names and dtypes, with no data: its order and dtype names."""
    from safetensors.torch import save

    raw = save({name: torch.empty(0, dtype=t.dtype) for name, t in tensors.items()})
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Write ``tensors`` to ``path`` in the safetensors format; returns the file's size in bytes.

    Not atomic by itself: write into ``fileio.atomic_path``. Tensors are written as they are, in
    their own dtype; a tensor on another device is copied to the CPU first.
    """
    layout = _layout(tensors)
    # the metadata as given (safetensors orders several keys arbitrarily; one key, as here, is one order)
    header: dict = {} if metadata is None else {"__metadata__": dict(metadata)}
    offset = 0
    for name, entry in layout.items():
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": entry["dtype"], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name in layout:
            t = tensors[name].detach().cpu().contiguous()  # no copy for a CPU tensor in one block
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return 8 + len(head) + offset
