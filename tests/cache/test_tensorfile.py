"""The package's safetensors writer: the same bytes as safetensors' own, and a failed write is a real OS error."""

from __future__ import annotations

import errno
import random
import resource
import signal

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from dflash_cb.common.fileio import atomic_path
from dflash_cb.common.tensorfile import write_safetensors

DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)


def random_tensors(rng: random.Random, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A few tensors of mixed dtypes and shapes (empty and 0-d among them) under awkward names."""
    out = {}
    for _ in range(rng.randint(1, 7)):
        name = "".join(rng.choice('ab/_.9Zé"\\\n') for _ in range(rng.randint(1, 6)))
        shape = [rng.randint(0, 4) for _ in range(rng.randint(0, 3))]
        out[name] = (torch.randn(shape, generator=g) * 5).to(rng.choice(DTYPES))
    return out


def test_files_are_byte_for_byte_what_safetensors_writes(tmp_path):
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    path = tmp_path / "t.safetensors"
    for _ in range(150):
        tensors = random_tensors(rng, g)
        metadata = rng.choice([None, {}, {"format": "pt"}])
        size = write_safetensors(path, tensors, metadata)
        assert path.read_bytes() == save(tensors, metadata=metadata) and size == path.stat().st_size
    shard = {"p001/input_ids": torch.arange(7), "p001/hidden": torch.randn(7, 6, generator=g).bfloat16(),
             "p001/target_argmax": torch.arange(7).flip(0)}
    write_safetensors(path, {**shard, "p001/hidden_t": shard["p001/hidden"].t()}, {"format": "pt"})  # not contiguous
    with safe_open(str(path), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(k), v) for k, v in shard.items())
        assert torch.equal(f.get_tensor("p001/hidden_t"), shard["p001/hidden"].t())


def test_a_failed_write_is_an_os_error_with_its_errno_naming_the_file(tmp_path):
    """A write past ``ulimit -f`` (as a full disk would) fails with the OS's own errno, names the
    destination, and leaves neither the file nor a temporary one."""
    path = tmp_path / "states-00000.safetensors"
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old_limit[1]))
    try:
        with pytest.raises(OSError) as e, atomic_path(path) as tmp:
            write_safetensors(tmp, {"hidden": torch.zeros(10_000)})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert e.value.errno == errno.EFBIG and e.value.filename == str(path)
    assert list(tmp_path.iterdir()) == []
