r"""Embed a dataset with a trained ConvMixer (as the paper's step 1, Sec. 5, Fig. 2 left), cached.

    python -m experiments.embed --embedder=/tmp/convmixer_quick --dataset=cifar10_jpeg \
        --out=/tmp/emb/cifar10_jpeg.npz

Writes the train and test embeddings (float32 [N, dim], the ConvMixer's average-pool output before
its head) with their labels to one `.npz` (`sdm_jax.data.embeddings.save_embeddings`), which
`sdm_jax.data.load_dataset('embeddings', data_dir=FILE)` reads. The file records the embedder
(folder and `embedder_key`, a sha256 of every file of the saved embedder), the dataset and its
source, and whether the pixels were the LOSSY JPEG stand-in.

Caching: if the output file exists and was made by the same embedder key from the same dataset and
source, it is reused; otherwise (new checkpoint, other data) it is recomputed and overwritten. Without
--out the file is EMBEDDER/embeddings/<dataset>-<key[:16]>.npz.
"""

from __future__ import annotations

import hashlib
import pathlib
import time

from absl import app, flags, logging

from sdm_jax import data
from sdm_jax.engine import convmixer
from sdm_jax.data import embeddings
from sdm_jax.runs import compilation_cache


def embedder_dir(path) -> pathlib.Path:
  from experiments import train_convmixer  # pylint: disable=g-import-not-at-top

  path = pathlib.Path(path).absolute()
  return path / train_convmixer.EMBEDDER_DIR if (path / train_convmixer.EMBEDDER_DIR).is_dir() else path


def embedder_key(path) -> str:
  """sha256 over the relative paths and bytes of the saved embedder's files (meta.json, variables/).

  The default output folder `embeddings/` sits inside the embedder folder and is left out.
  """
  root = embedder_dir(path)
  files = sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).parts[0] != "embeddings")
  if not files:
    raise FileNotFoundError(f"{root} holds no saved embedder")
  h = hashlib.sha256()
  for p in files:
    h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
  return h.hexdigest()


def embed_dataset(
  embedder, dataset: str, out=None, *, data_dir=None, batch_size: int = 1000, num_devices: int | None = None
) -> tuple[pathlib.Path, bool]:
  """Writes (or reuses) the embedding file; returns (path, whether it was computed now)."""
  from experiments import train_convmixer  # pylint: disable=g-import-not-at-top

  key = embedder_key(embedder)
  out = pathlib.Path(out) if out else embedder_dir(embedder) / "embeddings" / f"{dataset}-{key[:16]}.npz"
  start = time.perf_counter()
  ds = data.load_dataset(dataset, data_dir=data_dir)
  wanted = dict(dataset=dataset, dataset_source=ds["source"], embedder_key=key)
  old = embeddings.read_meta(out) if out.is_file() else None
  if old is not None and all(old.get(k) == v for k, v in wanted.items()):
    logging.info(f"cached: {out} (embedder key {key[:16]}, {ds['source']})")
    return out, False
  if old is not None:
    logging.info(
      f"stale: {out} was made by embedder key {str(old.get('embedder_key'))[:16]} from "
      f"{old.get('dataset')!r}; recomputing"
    )
  model, variables, meta = train_convmixer.load_embedder(embedder)
  mesh = convmixer.data_mesh(num_devices)
  result = {}
  for split in ("train", "test"):
    result[split] = convmixer.embed_arrays(model, variables, ds[f"{split}_images"], mesh=mesh, batch_size=batch_size)
  embeddings.save_embeddings(
    out,
    train_embeddings=result["train"],
    train_labels=ds["train_labels"],
    test_embeddings=result["test"],
    test_labels=ds["test_labels"],
    meta=dict(
      wanted,
      lossy=bool(ds.get("lossy", False)),
      embedder=str(embedder_dir(embedder)),
      dim=int(result["train"].shape[1]),
      num_classes=int(ds.get("num_classes", int(ds["train_labels"].max()) + 1)),
      embedder_dataset=meta.get("dataset"),
      embedder_test_accuracy=meta.get("test_accuracy"),
    ),
  )
  logging.info(
    f"wrote {out}: train {result['train'].shape}, test {result['test'].shape} in "
    f"{time.perf_counter() - start:.1f}s; embedder key {key[:16]}; data: {ds['source']}"
  )
  return out, True


def _define_flags() -> None:
  """CLI flags, defined only when run as a script: importing this module (tests, other experiments)
  must not add absl flags that clash with theirs in one process."""
  flags.DEFINE_string("embedder", None, "train_convmixer workdir (or its embedder/ folder).")
  flags.DEFINE_string("dataset", "cifar10_jpeg", "Dataset name for sdm_jax.data.load_dataset.")
  flags.DEFINE_string("data_dir", None, "Data folder for the dataset (default: the loader's search).")
  flags.DEFINE_string("out", None, "Output .npz (default: EMBEDDER/embeddings/<dataset>-<key>.npz).")
  flags.DEFINE_integer("batch_size", 1000, "Images per forward pass (a multiple of the device count).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  if not f.embedder:
    raise app.UsageError("--embedder=DIR is required (a train_convmixer workdir)")
  compilation_cache.enable()  # before anything compiles (docs/guide/runs.md, "The compilation cache")
  path, _ = embed_dataset(f.embedder, f.dataset, f.out, data_dir=f.data_dir, batch_size=f.batch_size)
  print(path)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
