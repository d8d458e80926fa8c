import numpy as np
import pytest

from mtp_jax import data


@pytest.mark.parametrize("text", ["", "hello", "naïve café — 東京 🚀", "tab\tnew\nline"])
def test_encode_decode_round_trip(text):
  ids = data.encode(text)
  assert ids[0] == data.BOS_ID
  assert all(0 <= i < data.VOCAB_SIZE for i in ids)
  assert data.decode(ids) == text
  assert data.encode(text, bos=False) == ids[1:]


def test_decode_stops_at_eos_and_replaces_cut_characters():
  ids = data.encode("ab") + [data.EOS_ID] + data.encode("cd", bos=False)
  assert data.decode(ids) == "ab"
  cut = data.encode("é", bos=False)[:1]
  assert data.decode(cut) == "\ufffd"
  assert data.decode(np.array(data.encode("xy"), np.int32)) == "xy"
  with pytest.raises(ValueError, match="300"):
    data.decode([300])


def test_file_lists_are_fixed_sorted_and_disjoint():
  assert data.CORPUS_FILES == tuple(sorted(data.CORPUS_FILES))
  assert len(set(data.CORPUS_FILES)) == len(data.CORPUS_FILES)
  assert set(data.HELDOUT_FILES) <= set(data.CORPUS_FILES)
  assert not set(data.TRAIN_FILES) & set(data.HELDOUT_FILES)
  assert set(data.TRAIN_FILES) | set(data.HELDOUT_FILES) == set(data.CORPUS_FILES)


def test_corpus_is_deterministic_and_splits_differ():
  train, heldout = data.load_corpus("train"), data.load_corpus("heldout")
  assert len(train) > 1_000_000 and len(heldout) > 50_000
  assert train == data.load_corpus("train")
  assert train[:200] != heldout[:200]
  assert b"def " in heldout and b"import " in train
  with pytest.raises(ValueError, match="split"):
    data.load_corpus("test")


def test_corpus_tolerates_a_few_missing_files_but_not_many(monkeypatch, tmp_path):
  for name in data.CORPUS_FILES[: len(data.CORPUS_FILES) // 2 + 1]:
    path = tmp_path.joinpath(*name.split("/"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x = 1\n")
  monkeypatch.setattr(data, "_stdlib_root", lambda: str(tmp_path))
  data._read_files.cache_clear()
  try:
    assert data.load_corpus("train").startswith(b"x = 1\n")
    for name in data.CORPUS_FILES[:2]:
      tmp_path.joinpath(*name.split("/")).unlink()
    data._read_files.cache_clear()
    with pytest.raises(RuntimeError, match="incomplete"):
      data.load_corpus("train")
  finally:
    data._read_files.cache_clear()


def test_batches_shape_dtype_determinism():
  corpus = data.load_corpus("heldout")
  stream = data.batches(corpus, batch_size=4, seq_len=16, seed=3)
  a = [next(stream) for _ in range(3)]
  b = next(data.batches(corpus, batch_size=4, seq_len=16, seed=3))
  assert a[0].shape == (4, 17) and a[0].dtype == np.int32
  np.testing.assert_array_equal(a[0], b)
  assert not np.array_equal(a[0], a[1])
  assert not np.array_equal(a[0], next(data.batches(corpus, batch_size=4, seq_len=16, seed=4)))
  assert a[0].min() >= 0 and a[0].max() < 256
  # Every row is a contiguous slice of the corpus.
  assert bytes(a[2][0].astype(np.uint8)) in corpus
  with pytest.raises(ValueError, match="fewer"):
    next(data.batches(b"short", batch_size=1, seq_len=8, seed=0))


def test_heldout_prompts():
  prompts = data.heldout_prompts(5, prompt_len=24, seed=0)
  assert prompts == data.heldout_prompts(5, prompt_len=24, seed=0)
  assert prompts != data.heldout_prompts(5, prompt_len=24, seed=1)
  heldout = data.load_corpus("heldout")
  assert len({tuple(p) for p in prompts}) == 5
  for p in prompts:
    assert len(p) == 24 and all(0 <= t < 256 for t in p)
    chunk = bytes(p)
    assert chunk[:1] != b"\n"
    assert b"\n" + chunk in b"\n" + heldout  # found at a line start
