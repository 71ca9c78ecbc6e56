"""Writes the ON/OFF encoding of the JPEG stand-in as an embedding file.

    PROBE_DIR=/tmp/pixprobe python make_onoff.py      # -> $PROBE_DIR/onoff_dataset.npz

Each image x in [0, 1]^3072 becomes [relu(x − μ), relu(μ − x)] in R^6144, with μ the
per-pixel mean of the training set: a fixed transform, nothing learned. Prints the
mean ± std pairwise cosine of 2,000 training images before and after.
"""
import os

import numpy as np

from sdm_jax import data
from sdm_jax.data import embeddings

out_dir = os.environ.get("PROBE_DIR", "/tmp/pixprobe")
ds = data.load_dataset("cifar10_jpeg")
flat = lambda images: images.reshape(len(images), -1).astype(np.float32) / 255
train, test = flat(ds["train_images"]), flat(ds["test_images"])
mean = train.mean(0, keepdims=True)
onoff = lambda x: np.concatenate([np.maximum(x - mean, 0), np.maximum(mean - x, 0)], 1)


def cosines(x):
  x = x[:2000] / np.linalg.norm(x[:2000], axis=1, keepdims=True)
  pairs = (x @ x.T)[np.triu_indices(len(x), 1)]
  return f"{pairs.mean():.2f} ± {pairs.std():.2f}"


train_onoff = onoff(train)
print(f"pairwise cosine: raw {cosines(train)}, ON/OFF {cosines(train_onoff)}")
os.makedirs(out_dir, exist_ok=True)
embeddings.save_embeddings(
    os.path.join(out_dir, "onoff_dataset.npz"), train_embeddings=train_onoff, train_labels=ds["train_labels"],
    test_embeddings=onoff(test), test_labels=ds["test_labels"],
    meta=dict(dataset="cifar10_jpeg", dataset_source=ds["source"], lossy=True, embedder="onoff-dataset (no learning)",
              embedder_key="onoff-dataset-v1", dim=train_onoff.shape[1]))
