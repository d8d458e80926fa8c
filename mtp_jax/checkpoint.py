"""safetensors IO: whole-dict save / load, and a lazy reader for single or sharded checkpoints that
reads whole tensors or blocks of them."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so BF16 tensors load)
import numpy as np
import safetensors
import safetensors.numpy

INDEX_SUFFIX = ".safetensors.index.json"


def save_tensors(path, tensors: Mapping[str, object], *,
                 metadata: dict[str, str] | None = None) -> None:
  """Writes array-likes (numpy, jax, nested lists) of any shape / dtype to one .safetensors file."""
  arrays = {name: np.ascontiguousarray(np.asarray(value)) for name, value in tensors.items()}
  safetensors.numpy.save_file(arrays, os.fspath(path), metadata=metadata)


def read_metadata(file) -> dict[str, str]:
  """The string metadata in a .safetensors file's header ({} when it has none)."""
  try:
    with safetensors.safe_open(os.fspath(file), framework="numpy") as f:
      return dict(f.metadata() or {})
  except safetensors.SafetensorError as e:
    raise ValueError(f"{file} is not a valid safetensors file (corrupted or truncated?): {e}") from e


def load_tensors(path) -> dict[str, np.ndarray]:
  """Every tensor of a checkpoint (file, directory or sharded index), by name, as stored."""
  with CheckpointReader(path) as reader:
    return {name: reader.get(name) for name in reader.keys()}


@dataclasses.dataclass(frozen=True)
class TensorSource:
  """A tensor not read yet: its shape, and read(index) -> x[index] as a numpy array (index: a tuple
  of slices, one per dimension; None: the whole tensor). np.asarray(source) reads it whole."""
  shape: tuple[int, ...]
  read: Callable[[tuple[slice, ...] | None], np.ndarray]

  def __array__(self, dtype=None, copy=None) -> np.ndarray:
    return np.asarray(self.read(None), dtype)


def _find_index_or_file(path: str) -> str:
  if not os.path.exists(path):
    raise FileNotFoundError(f"no checkpoint at {path}")
  if not os.path.isdir(path):
    return path
  indexes = sorted(f for f in os.listdir(path) if f.endswith(INDEX_SUFFIX))
  singles = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if len(indexes) > 1:
    raise ValueError(f"{path} holds several shard indexes {indexes}; pass one of them")
  if indexes:
    return os.path.join(path, indexes[0])
  if len(singles) == 1:
    return os.path.join(path, singles[0])
  raise ValueError(
      f"{path} must hold one .safetensors file or a *{INDEX_SUFFIX}, found {singles or 'none'}")


def _read_weight_map(index: str) -> dict[str, str]:
  try:
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{index}: not a shard index with a weight_map ({e})") from e
  folder = os.path.dirname(index)
  return {name: os.path.join(folder, shard) for name, shard in weight_map.items()}


class CheckpointReader:
  """Lazy read access to a `.safetensors` file, a directory holding one, or a sharded checkpoint.

  Shards are memory-mapped on first use, and only the tensors asked for are copied out.
  """

  def __init__(self, path):
    self.path = _find_index_or_file(os.fspath(path))
    self._open = {}  # shard file -> safe_open handle
    self._names_in = {}  # shard file -> the tensor names its header lists
    if self.path.endswith(INDEX_SUFFIX):
      self._file_of_name = _read_weight_map(self.path)
    else:
      self._file_of_name = dict.fromkeys(self._handle(self.path).keys(), self.path)

  def _handle(self, file: str):
    if file not in self._open:
      if not os.path.isfile(file):
        raise FileNotFoundError(f"checkpoint {self.path} names a missing shard file {file}")
      try:
        handle = safetensors.safe_open(file, framework="numpy")
      except safetensors.SafetensorError as e:
        raise ValueError(f"{file} is not a valid safetensors file (corrupted or truncated?): "
                         f"{e}") from e
      self._open[file], self._names_in[file] = handle, set(handle.keys())
    return self._open[file]

  def keys(self) -> list[str]:
    return list(self._file_of_name)

  def __contains__(self, name: str) -> bool:
    return name in self._file_of_name

  def _file_of(self, name: str) -> str:
    file = self._file_of_name.get(name)
    if file is None:
      raise KeyError(f"tensor {name!r} is not in checkpoint {self.path}")
    self._handle(file)
    if name not in self._names_in[file]:
      raise KeyError(f"tensor {name!r} is listed in {self.path} but missing from shard {file}")
    return file

  def get(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    """The tensor with its stored dtype (BF16 comes back as ml_dtypes.bfloat16), or with index (a
    tuple of slices, as x[index]) only that block of it, read from the file without the rest."""
    file = self._file_of(name)
    try:
      handle = self._handle(file)
      return handle.get_tensor(name) if index is None else handle.get_slice(name)[tuple(index)]
    except Exception as e:  # the rust reader's errors carry no type worth telling apart
      raise ValueError(f"could not read tensor {name!r} from {file}: {e}") from e

  def __getitem__(self, name: str) -> np.ndarray:
    return self.get(name)

  def source(self, name: str) -> TensorSource:
    """The tensor as a TensorSource reading from this reader (while it is open)."""
    return TensorSource(self.shape(name), lambda index: self.get(name, index))

  def stacked(self, names: Sequence[str]) -> TensorSource:
    """The 2-D tensors `names` (each [out, in], one shape) transposed and stacked: [N, in, out], as
    released MoE experts become mtp_jax's stacked experts. A block reads only the tensors it covers,
    and of each only its [out, in] block."""
    names = list(names)
    rows, cols = self.shape(names[0])

    def read(index):
      chosen, i, o = index or (slice(None),) * 3
      out = None
      for k, name in enumerate(names[chosen]):
        block = self.get(name, (o, i)).T
        if out is None:  # filled in place: the host holds this block once, not a list of parts too
          out = np.empty((len(names[chosen]),) + block.shape, block.dtype)
        out[k] = block
      return out

    return TensorSource((len(names), cols, rows), read)

  def shape(self, name: str) -> tuple[int, ...]:
    """The stored shape, read from the file header without loading the tensor."""
    return tuple(self._handle(self._file_of(name)).get_slice(name).get_shape())

  def close(self) -> None:
    for handle in self._open.values():
      handle.__exit__(None, None, None)
    self._open.clear()

  def __enter__(self) -> "CheckpointReader":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
