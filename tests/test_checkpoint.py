import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

from mtp_jax.checkpoint import CheckpointReader, Fp8Blocks, dequantize_fp8_blocks, load_tensors, save_tensors


def _tensors():
  rng = np.random.default_rng(0)
  return {
      "a.weight": rng.standard_normal((4, 3)).astype(np.float32),
      "b.bias": np.arange(5, dtype=np.int32),
      "c.half": rng.standard_normal((2, 2)).astype(np.float16),
      "d.bf16": rng.standard_normal((3,)).astype(ml_dtypes.bfloat16),
  }


def _assert_same(got, want):
  assert set(got) == set(want)
  for name in want:
    assert got[name].dtype == want[name].dtype, name
    np.testing.assert_array_equal(got[name], want[name])


def _write_sharded(folder, tensors, shards):
  """shards: file name -> tensor names it holds."""
  folder.mkdir(exist_ok=True)
  for file, names in shards.items():
    save_tensors(folder / file, {n: tensors[n] for n in names})
  weight_map = {n: file for file, names in shards.items() for n in names}
  (folder / "model.safetensors.index.json").write_text(
      json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def test_save_load_round_trip_with_metadata(tmp_path):
  tensors = _tensors()
  path = tmp_path / "x.safetensors"
  save_tensors(path, {**tensors, "e.jax": jnp.ones((2,), jnp.float32)}, metadata={"k": "v"})
  got = load_tensors(path)
  np.testing.assert_array_equal(got.pop("e.jax"), np.ones(2, np.float32))
  _assert_same(got, tensors)
  with safetensors.safe_open(str(path), "numpy") as f:
    assert f.metadata() == {"k": "v"}
  # A non-contiguous view is written by value.
  save_tensors(path, {"t": np.arange(6.0).reshape(2, 3).T})
  np.testing.assert_array_equal(load_tensors(path)["t"], np.arange(6.0).reshape(2, 3).T)


def test_reader_single_file_and_directory(tmp_path):
  tensors = _tensors()
  save_tensors(tmp_path / "model.safetensors", tensors)
  for path in (tmp_path / "model.safetensors", tmp_path, str(tmp_path)):
    with CheckpointReader(path) as reader:
      assert sorted(reader.keys()) == sorted(tensors)
      assert "a.weight" in reader and "zzz" not in reader
      assert reader.shape("a.weight") == (4, 3)
      _assert_same({n: reader.get(n) for n in reader.keys()}, tensors)
      np.testing.assert_array_equal(reader["b.bias"], tensors["b.bias"])


def test_reader_sharded_is_lazy(tmp_path, monkeypatch):
  tensors = _tensors()
  _write_sharded(tmp_path / "ck", tensors, {
      "model-00001-of-00002.safetensors": ["a.weight", "b.bias"],
      "model-00002-of-00002.safetensors": ["c.half", "d.bf16"]})
  opened = []
  real_open = safetensors.safe_open
  monkeypatch.setattr(safetensors, "safe_open",
                      lambda f, **kw: opened.append(f) or real_open(f, **kw))
  reader = CheckpointReader(tmp_path / "ck")
  assert sorted(reader.keys()) == sorted(tensors) and opened == []
  assert reader.shape("c.half") == (2, 2)
  np.testing.assert_array_equal(reader.get("c.half"), tensors["c.half"])
  assert [f.rsplit("/", 1)[1] for f in opened] == ["model-00002-of-00002.safetensors"]
  reader.close()
  _assert_same(load_tensors(tmp_path / "ck" / "model.safetensors.index.json"), tensors)


def test_blocks_and_stacked_experts_read_only_their_part(tmp_path):
  """get(name, index) reads one block; a block of reader.stacked(...) (experts [out, in] -> [E, in, out])
  reads only the experts it covers, and of each only its block."""
  rng = np.random.default_rng(0)
  experts = {f"e.{k}.w": rng.standard_normal((6, 4)).astype(ml_dtypes.bfloat16) for k in range(4)}
  save_tensors(tmp_path / "x.safetensors", experts)
  with CheckpointReader(tmp_path / "x.safetensors") as reader:
    np.testing.assert_array_equal(reader.get("e.1.w", (slice(2, 5), slice(None))), experts["e.1.w"][2:5])
    read = []
    get = reader.get
    reader.get = lambda name, index=None: read.append(name) or get(name, index)
    stacked = reader.stacked([f"e.{k}.w" for k in range(4)])
    assert stacked.shape == (4, 4, 6)
    whole = np.stack([experts[f"e.{k}.w"].T for k in range(4)])
    block = stacked.read((slice(2, 4), slice(0, 2), slice(3, 6)))
    assert block.dtype == ml_dtypes.bfloat16 and read == ["e.2.w", "e.3.w"]
    np.testing.assert_array_equal(block, whole[2:4, 0:2, 3:6])
    np.testing.assert_array_equal(np.asarray(stacked), whole)


def test_missing_files_and_tensors_are_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="nowhere"):
    CheckpointReader(tmp_path / "nowhere")
  with pytest.raises(ValueError, match="none"):
    CheckpointReader(tmp_path)
  save_tensors(tmp_path / "one.safetensors", {"x": np.zeros(2, np.float32)})
  save_tensors(tmp_path / "two.safetensors", {"y": np.zeros(2, np.float32)})
  with pytest.raises(ValueError, match="one.safetensors"):
    CheckpointReader(tmp_path)
  reader = CheckpointReader(tmp_path / "one.safetensors")
  with pytest.raises(KeyError, match=r"'y'.*one\.safetensors"):
    reader.get("y")
  with pytest.raises(KeyError, match="'y'"):
    reader.shape("y")

  tensors = _tensors()
  _write_sharded(tmp_path / "ck", tensors, {"s1.safetensors": ["a.weight", "b.bias"],
                                            "s2.safetensors": ["c.half", "d.bf16"]})
  (tmp_path / "ck" / "s2.safetensors").unlink()
  reader = CheckpointReader(tmp_path / "ck")
  np.testing.assert_array_equal(reader.get("a.weight"), tensors["a.weight"])
  with pytest.raises(FileNotFoundError, match="s2.safetensors"):
    reader.get("c.half")
  # The index lists a tensor that its shard does not hold.
  index = tmp_path / "ck" / "model.safetensors.index.json"
  weight_map = json.loads(index.read_text())["weight_map"]
  index.write_text(json.dumps({"weight_map": {**weight_map, "ghost": "s1.safetensors"}}))
  with pytest.raises(KeyError, match=r"'ghost'.*s1\.safetensors"):
    CheckpointReader(tmp_path / "ck").get("ghost")
  index.write_text("{not json")
  with pytest.raises(ValueError, match=r"index\.json is not valid JSON"):
    CheckpointReader(tmp_path / "ck")
  index.write_text(json.dumps({"weight_map": ["a.weight"]}))
  with pytest.raises(ValueError, match="weight_map must be an object"):
    CheckpointReader(tmp_path / "ck")


@pytest.mark.parametrize("damage", ["truncate", "truncate_header", "garble_header", "empty"])
def test_corrupted_file_is_named(tmp_path, damage):
  path = tmp_path / "bad.safetensors"
  save_tensors(path, {"w": np.ones((64, 64), np.float32)})
  raw = path.read_bytes()
  if damage == "truncate":
    raw = raw[: len(raw) // 2]
  elif damage == "truncate_header":
    raw = raw[:20]
  elif damage == "garble_header":
    raw = raw[:12] + b"#garbage#" + raw[21:]
  else:
    raw = b""
  path.write_bytes(raw)
  with pytest.raises(ValueError, match=r"bad\.safetensors.*(corrupted|truncated)"):
    CheckpointReader(path)
  with pytest.raises(ValueError, match=r"bad\.safetensors"):
    load_tensors(path)


def test_fp8_blocks_dequantize_whole_and_sliced(tmp_path):
  """Each element times its block's scale; partial edge blocks; a slice with its offset equals the
  same slice of the whole; the reader hides the scales and dequantizes to the asked dtype."""
  rng = np.random.default_rng(0)
  w = rng.uniform(-2, 2, (20, 30)).astype(ml_dtypes.float8_e4m3fn)
  scale = rng.uniform(0.5, 4, (3, 3)).astype(np.float32)  # blocks of 8 x 12: rows 8+8+4, cols 12+12+6
  want = w.astype(np.float32) * np.repeat(np.repeat(scale, 8, 0)[:20], 12, 1)[:, :30]
  np.testing.assert_array_equal(dequantize_fp8_blocks(w, scale, (8, 12)), want)
  np.testing.assert_array_equal(dequantize_fp8_blocks(w[9:17, 13:29], scale[1:3, 1:3], (8, 12), offset=(9, 13)),
                                want[9:17, 13:29])
  safetensors.torch.save_file({"p.weight": torch.from_numpy(w.view(np.uint8)).view(torch.float8_e4m3fn),
                               "p.weight_scale_inv": torch.from_numpy(scale)}, tmp_path / "q.safetensors")
  plain = CheckpointReader(tmp_path / "q.safetensors")
  assert sorted(plain.keys()) == ["p.weight", "p.weight_scale_inv"] and plain.get("p.weight").dtype == w.dtype
  reader = CheckpointReader(tmp_path / "q.safetensors", fp8=Fp8Blocks((8, 12), "bfloat16"))
  assert reader.keys() == ["p.weight"] and "p.weight_scale_inv" not in reader
  got = reader.get("p.weight")
  assert got.dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(got, want.astype(ml_dtypes.bfloat16))
  # A block read alone is dequantized with the scale blocks under it (mesh loads read so).
  np.testing.assert_array_equal(reader.get("p.weight", (slice(9, 17), slice(13, 29))), got[9:17, 13:29])
  with pytest.raises(ValueError, match=r"scale 'p.weight_scale_inv' has shape \(3, 3\), expected \(2, 3\)"):
    CheckpointReader(tmp_path / "q.safetensors", fp8=Fp8Blocks((16, 12))).get("p.weight")
