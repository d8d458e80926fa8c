"""safetensors IO: whole-dict save / load, and a lazy reader for single or sharded checkpoints that
reads whole tensors or blocks of them, dequantizing block-scaled FP8 weights as it reads them."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence

import ml_dtypes  # also registers bfloat16 with numpy, so BF16 tensors load
import numpy as np
import safetensors
import safetensors.numpy

from mtp_jax import validate

INDEX_SUFFIX = ".safetensors.index.json"
# safetensors dtypes that safetensors.numpy cannot name: read from the file as ml_dtypes arrays.
_ML_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
              "F8_E8M0": ml_dtypes.float8_e8m0fnu}
SCALE_SUFFIX = "_scale_inv"  # <name>.weight_scale_inv holds the block scales of <name>.weight


@dataclasses.dataclass(frozen=True)
class Fp8Blocks:
  """Block-scaled FP8 weights (config.json quantization_config, quant_method "fp8"): each float8
  weight [R, C] stored with `<name>.weight_scale_inv` float32[ceil(R / block[0]), ceil(C / block[1])]
  is dequantized to `dtype`: by the reader as it is read, or (a module's `fp8`, blocks.linear.keep_fp8)
  inside the matmul."""
  block: tuple[int, int]
  dtype: str = "float32"


def dequantize_fp8_blocks(weight_RxC: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int],
                          offset: tuple[int, int] = (0, 0)) -> np.ndarray:
  """float32[R, C]: each element of a float8 weight times the scale of the block holding it.

  weight_RxC may be a slice of the stored tensor, its [0, 0] at the stored `offset`; scale_inv
  then starts at the block holding that element. The stored shape need not be a multiple of the
  block: the last block of a row or column covers what is left (as transformers' finegrained_fp8
  reads DeepSeek-V3's 576-row kv_a_proj_with_mqa)."""
  rows = (np.arange(weight_RxC.shape[0]) + offset[0]) // block[0] - offset[0] // block[0]
  cols = (np.arange(weight_RxC.shape[1]) + offset[1]) // block[1] - offset[1] // block[1]
  out = weight_RxC.astype(np.float32)
  out *= scale_inv.astype(np.float32)[rows[:, None], cols[None, :]]
  return out


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
  fp8: Fp8Parts | None = None  # the stored parts of a block-scaled FP8 tensor (read dequantizes them)

  def __array__(self, dtype=None, copy=None) -> np.ndarray:
    return np.asarray(self.read(None), dtype)


@dataclasses.dataclass(frozen=True)
class Fp8Parts:
  """A block-scaled FP8 tensor as stored, for loaders that keep it so (quantized="fp8"): values
  float8_e4m3fn[..., R, C] and scale_inv float32[..., ceil(R / block[0]), ceil(C / block[1])], each read
  undequantized."""
  values: TensorSource
  scale_inv: TensorSource
  block: tuple[int, int]


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


def read_json(file) -> dict:
  """The JSON object in `file` (config.json, a shard index). A missing file is a FileNotFoundError;
  invalid JSON a validate.InvalidValue and any other JSON value (a list, a number) a
  validate.InvalidType, each naming the file."""
  file = os.fspath(file)
  try:
    with open(file, encoding="utf-8") as f:
      value = json.load(f)
  except UnicodeDecodeError as e:
    raise validate.InvalidValue(file, f"{file} is not UTF-8 text: {e}") from e
  except json.JSONDecodeError as e:
    raise validate.InvalidValue(file, f"{file} is not valid JSON: {e}") from e
  if not isinstance(value, dict):
    raise validate.InvalidType(file, f"{file} must hold a JSON object {{...}}, got a JSON {type(value).__name__}")
  return value


def _read_weight_map(index: str) -> dict[str, str]:
  weight_map = read_json(index).get("weight_map")
  if not isinstance(weight_map, dict):
    raise validate.InvalidValue(f"{index}: weight_map", f"{index}: not a shard index: weight_map must be an "
                                f"object of tensor name -> shard file, got {weight_map!r:.60}")
  bad = next(((n, v) for n, v in weight_map.items() if not isinstance(v, str) or not v), None)
  if bad is not None:
    raise validate.InvalidType(f"{index}: weight_map[{bad[0]!r}]", f"{index}: weight_map[{bad[0]!r}] must name a "
                               f"shard file (a non-empty string), got {bad[1]!r:.60}")
  folder = os.path.dirname(index)
  return {name: os.path.join(folder, shard) for name, shard in weight_map.items()}


def _stack(sources: Sequence[TensorSource]) -> TensorSource:
  """2-D sources (each [out, in], one shape) transposed and stacked: [N, in, out]; a block reads only
  the sources it covers, and of each only its [out, in] block."""
  rows, cols = sources[0].shape

  def read(index):
    chosen, i, o = index or (slice(None),) * 3
    out = None
    for k, source in enumerate(sources[chosen]):
      block = source.read((o, i)).T
      if out is None:  # filled in place: the host holds this block once, not a list of parts too
        out = np.empty((len(sources[chosen]),) + block.shape, block.dtype)
      out[k] = block
    return out

  return TensorSource((len(sources), cols, rows), read)


class CheckpointReader:
  """Lazy read access to a `.safetensors` file, a directory holding one, or a sharded checkpoint.

  Shards are memory-mapped on first use, and only the tensors asked for are copied out.
  """

  def __init__(self, path, *, fp8: Fp8Blocks | None = None):
    self.path = _find_index_or_file(os.fspath(path))
    self.fp8 = fp8
    self._open = {}  # shard file -> safe_open handle
    self._names_in = {}  # shard file -> the tensor names its header lists
    self._headers = {}  # shard file -> (its JSON header, where its data starts), for ml_dtypes reads
    if self.path.endswith(INDEX_SUFFIX):
      self._file_of_name = _read_weight_map(self.path)
    else:
      self._file_of_name = dict.fromkeys(self._handle(self.path).keys(), self.path)
    # With fp8: weight name -> its scale's name; the scales are read with their weights, not listed.
    self._scale_of = {} if fp8 is None else {
        n.removesuffix(SCALE_SUFFIX): n for n in self._file_of_name
        if n.endswith(".weight" + SCALE_SUFFIX) and n.removesuffix(SCALE_SUFFIX) in self._file_of_name}
    self._scales = set(self._scale_of.values())

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
    """Every tensor name, less the FP8 scales read with their weights."""
    return [n for n in self._file_of_name if n not in self._scales]

  def __contains__(self, name: str) -> bool:
    return name in self._file_of_name and name not in self._scales

  def _file_of(self, name: str) -> str:
    file = self._file_of_name.get(name)
    if file is None:
      raise KeyError(f"tensor {name!r} is not in checkpoint {self.path}")
    if not os.path.isfile(file):
      raise FileNotFoundError(f"checkpoint {self.path} puts tensor {name!r} in a missing shard file {file}")
    self._handle(file)
    if name not in self._names_in[file]:
      raise KeyError(f"tensor {name!r} is listed in {self.path} but missing from shard {file}")
    return file

  def _stored(self, name: str, index: tuple[slice, ...] | None) -> np.ndarray:
    file = self._file_of(name)
    try:
      dtype = self._handle(file).get_slice(name).get_dtype()
      if dtype not in _ML_DTYPES:
        handle = self._handle(file)
        return handle.get_tensor(name) if index is None else handle.get_slice(name)[tuple(index)]
      if file not in self._headers:
        with open(file, "rb") as f:
          size = int.from_bytes(f.read(8), "little")
          self._headers[file] = json.loads(f.read(size)), 8 + size
      header, start = self._headers[file]
      begin, end = header[name]["data_offsets"]
      if index is None:
        data = np.fromfile(file, dtype=np.uint8, count=end - begin, offset=start + begin)
        return data.view(_ML_DTYPES[dtype]).reshape(header[name]["shape"])
      # Mapped, so that only the pages under the block are read.
      data = np.memmap(file, dtype=np.uint8, mode="r", offset=start + begin, shape=(end - begin,))
      return np.array(data.view(_ML_DTYPES[dtype]).reshape(header[name]["shape"])[tuple(index)])
    except Exception as e:  # the rust reader's errors carry no type worth telling apart
      raise ValueError(f"could not read tensor {name!r} from {file}: {e}") from e

  def get(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    """The tensor with its stored dtype (BF16 comes back as ml_dtypes.bfloat16, FP8 as
    ml_dtypes.float8_*), or with index (a tuple of slices, as x[index]) only that block of it, read
    from the file without the rest. With `fp8`, a float8 weight stored with a scale comes back
    dequantized (`dequantize_fp8_blocks`, a block with the scales of the blocks it covers), as fp8.dtype."""
    scale_name = self._scale_of.get(name)
    if scale_name is None:
      return self._stored(name, index)
    shape, block = self._checked_scale(name, scale_name), self.fp8.block
    ranges = [(0, n, 1) for n in shape]
    if index is not None:
      index = tuple(index) + (slice(None),) * (2 - len(index))
      ranges = [s.indices(n) for s, n in zip(index, shape)]
      if any(step != 1 for _, _, step in ranges):
        raise ValueError(f"{self.path}: FP8 weight {name!r} is read in contiguous blocks only, got index {index}")
    value = self._float8(name, scale_name, index, (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2))
    # The scale blocks covering the rows / columns read (none for an empty range).
    cover = tuple(slice(lo // b, -(-hi // b)) for (lo, hi, _), b in zip(ranges, block))
    scale = self._stored(scale_name, None if index is None else cover)
    offset = tuple(lo for lo, _, _ in ranges)
    return dequantize_fp8_blocks(value, scale, block, offset=offset).astype(self.fp8.dtype)

  def _checked_scale(self, name: str, scale_name: str) -> tuple[int, ...]:
    """The shape of weight `name`, its scale's shape checked against it and the block size."""
    shape, scale_shape, block = self.shape(name), self.shape(scale_name), self.fp8.block
    want = tuple(-(-n // b) for n, b in zip(shape, block))
    if len(shape) != 2 or scale_shape != want:
      raise ValueError(f"{self.path}: scale {scale_name!r} has shape {scale_shape}, expected {want} for weight "
                       f"{name!r} of shape {shape} in blocks of {block} (quantization_config.weight_block_size)")
    return shape

  def _float8(self, name: str, scale_name: str, index, dtypes) -> np.ndarray:
    value = self._stored(name, index)
    if value.dtype not in tuple(np.dtype(d) for d in dtypes):
      raise ValueError(f"{self.path}: tensor {name!r} has a scale {scale_name!r} but is stored as {value.dtype}, "
                       f"not {' or '.join(np.dtype(d).name for d in dtypes)}")
    return value

  def fp8_parts(self, name: str) -> Fp8Parts | None:
    """With `fp8`, a weight stored with a scale as its undequantized parts (values must be
    float8_e4m3fn); None for any other tensor."""
    scale_name = self._scale_of.get(name)
    if scale_name is None:
      return None
    shape = self._checked_scale(name, scale_name)
    values = TensorSource(shape, lambda index: self._float8(name, scale_name, index, (ml_dtypes.float8_e4m3fn,)))
    scale_inv = TensorSource(self.shape(scale_name), lambda index: self._stored(scale_name, index))
    return Fp8Parts(values=values, scale_inv=scale_inv, block=self.fp8.block)

  def __getitem__(self, name: str) -> np.ndarray:
    return self.get(name)

  def source(self, name: str) -> TensorSource:
    """The tensor as a TensorSource reading from this reader (while it is open); a block-scaled FP8
    weight reads dequantized and carries its stored parts (`fp8_parts`)."""
    return TensorSource(self.shape(name), lambda index: self.get(name, index), self.fp8_parts(name))

  def stacked(self, names: Sequence[str]) -> TensorSource:
    """The 2-D tensors `names` (each [out, in], one shape) transposed and stacked: [N, in, out], as
    released MoE experts become mtp_jax's stacked experts. A block reads only the tensors it covers,
    and of each only its [out, in] block. When every one is block-scaled FP8, its parts are stacked
    the same way (scales [N, ceil(in / block[1]), ceil(out / block[0])], in blocks of block[::-1])."""
    names = list(names)
    stacked = _stack([self.source(n) for n in names])
    parts = [self.fp8_parts(n) for n in names]
    if all(parts):
      stacked = dataclasses.replace(stacked, fp8=Fp8Parts(
          values=_stack([p.values for p in parts]), scale_inv=_stack([p.scale_inv for p in parts]),
          block=self.fp8.block[::-1]))
    return stacked

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
