"""Random-weight Qwen3 checkpoints in HF layout, for tests, benchmarks and the demo model.

`write_random_checkpoint` writes `config.json` plus `model.safetensors` (or shards
`model-0000i-of-0000n.safetensors` and `model.safetensors.index.json`) that both our loader and
`transformers.Qwen3ForCausalLM.from_pretrained` read.

Streaming: the safetensors header only needs names, dtypes and shapes, which the config fixes in
advance, so each file's header is written first and then one tensor at a time is generated,
written and dropped. Peak memory is the largest tensor (the embedding), never the model.

Determinism: each tensor's generator is seeded from (seed, tensor name), so the same seed gives
byte-identical files, and a sharded checkpoint holds exactly the weights of the unsharded one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import struct
import tempfile
import time
from pathlib import Path

import torch

from mili.engine.model.config import Qwen3Config
from mili.engine.model.kv_cache import dtype_name

_LOG = logging.getLogger("mili.engine")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

# safetensors' dtype codes for the dtypes we write.
_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
}


def tensor_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every weight of `config`'s model (in module order)."""
    # model and weight_map import nothing from here; no cycle
    from mili.engine.model.qwen3 import Qwen3ForCausalLM
    from mili.engine.model.weight_map import weight_map

    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    return {name: target.shape for name, target in weight_map(model).items()}


def shard_file_name(index: int, num_shards: int) -> str:
    """HF's shard naming, 1-based: model-00001-of-00003.safetensors."""
    return f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"


def write_random_checkpoint(
    path: Path | str,
    config: Qwen3Config,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int | None = None,
    std: float = 0.02,
) -> Path:
    """Write a deterministic random-weight checkpoint of `config` into directory `path`.

    Weights are N(0, std); norm weights are 1 + N(0, std) (the noise makes a dropped or swapped
    norm visible in logits); biases (attention_bias) are N(0, std). Shards hold at most
    `max_shard_bytes` each (one tensor larger than that gets a shard of its own); None writes a
    single file. Returns the directory.
    """
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"dtype must be one of {list(_SAFETENSORS_DTYPES)}, got {dtype}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shapes = tensor_shapes(config)
    shards = _plan_shards(shapes, itemsize, max_shard_bytes)

    config_dict = dataclasses.replace(config, torch_dtype=dtype_name(dtype)).to_hf_dict()
    (out / CONFIG_FILE).write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")

    if len(shards) == 1:
        file_names = [SINGLE_FILE]
    else:
        file_names = [shard_file_name(i, len(shards)) for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for file_name, names in zip(file_names, shards, strict=True):
        _write_safetensors(out / file_name, {n: shapes[n] for n in names}, dtype, seed, std)
        weight_map.update(dict.fromkeys(names, file_name))
    if len(shards) > 1:
        total = sum(_numel(s) for s in shapes.values()) * itemsize
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return out


def cached_random_checkpoint(
    config: Qwen3Config, name: str, cache_dir: Path, *, seed: int = 0
) -> Path:
    """`config` with random bf16 weights in `cache_dir/<name>-bf16-seed<seed>`, written on first
    use (into a staging directory, then renamed: no reader sees half a checkpoint).

    Safe for concurrent callers, processes included: each writes its own staging directory,
    the first rename wins, and a caller whose rename finds the target already in place uses
    that one (the same bytes: the weights depend on the seed only) and drops its own.
    """
    target = Path(cache_dir) / f"{name}-bf16-seed{seed}"
    if (target / CONFIG_FILE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        start = time.perf_counter()
        write_random_checkpoint(staging, config, seed=seed, dtype=torch.bfloat16)
        try:
            # rename(2) of a directory is atomic, and fails (ENOTEMPTY or EEXIST) when the
            # target is a directory with files in it: another writer got there first.
            staging.rename(target)
        except OSError:
            if not (target / CONFIG_FILE).exists():
                raise
            _LOG.info("%s: another process wrote %s first; using it", name, target)
        else:
            _LOG.info("wrote %s to %s in %.1f s", name, target, time.perf_counter() - start)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def random_tensor(
    name: str, shape: tuple[int, ...], *, seed: int, std: float, dtype: torch.dtype
) -> torch.Tensor:
    """The tensor `write_random_checkpoint` writes under `name` (generated in float32)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little"))
    t = torch.randn(shape, generator=generator, dtype=torch.float32, device="cpu").mul_(std)
    if name.endswith("norm.weight"):
        t.add_(1.0)
    return t.to(dtype)


def _plan_shards(
    shapes: dict[str, tuple[int, ...]], itemsize: int, max_shard_bytes: int | None
) -> list[list[str]]:
    """Greedy, in order: start a new shard when the next tensor would overflow this one."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = _numel(shape) * itemsize
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_safetensors(
    path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, seed: int, std: float
) -> None:
    """The safetensors format: u64 little-endian header length, JSON header, raw data.

    Header entries give each tensor's [begin, end) byte offsets into the data section, which we
    fill in the same order; the header is space-padded to 8 bytes so data stays aligned.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        nbytes = _numel(shape) * itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name, shape in shapes.items():
            t = random_tensor(name, shape, seed=seed, std=std, dtype=dtype)
            # A uint8 view of the tensor's own memory: no copy, whatever the dtype (bf16 too).
            f.write(t.contiguous().view(torch.uint8).numpy().data)
            del t


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
