"""ON/OFF pixel encoding of the JPEG stand-in: [relu(x - mu), relu(mu - x)], mu = per-pixel train mean."""
import os, sys, json, numpy as np
from sdm_jax import data
from sdm_jax.data import embeddings
ds = data.load_dataset('cifar10_jpeg')
tr = ds['train_images'].reshape(len(ds['train_images']), -1).astype(np.float32) / 255
te = ds['test_images'].reshape(len(ds['test_images']), -1).astype(np.float32) / 255
mode = sys.argv[1]
if mode == 'dataset':
  mu = tr.mean(0, keepdims=True); mt = mu
else:  # per-image
  mu = tr.mean(1, keepdims=True); mt = te.mean(1, keepdims=True)
onoff = lambda x, m: np.concatenate([np.maximum(x - m, 0), np.maximum(m - x, 0)], 1)
a, b = onoff(tr, mu), onoff(te, mt)
def cos_stats(x):
  x = x[:2000] / np.linalg.norm(x[:2000], axis=1, keepdims=True)
  c = x @ x.T; iu = np.triu_indices(len(x), 1); return float(c[iu].mean()), float(c[iu].std())
raw = tr[:2000]
print('raw cos', cos_stats(raw), 'onoff cos', cos_stats(a))
os.makedirs(os.environ.get('PROBE_DIR', '/tmp/pixprobe'), exist_ok=True)
embeddings.save_embeddings(os.path.join(os.environ.get('PROBE_DIR', '/tmp/pixprobe'), f'onoff_{mode}.npz'), train_embeddings=a, train_labels=ds['train_labels'],
  test_embeddings=b, test_labels=ds['test_labels'],
  meta=dict(dataset='cifar10_jpeg', dataset_source=ds['source'], lossy=True, embedder=f'onoff-{mode} (no learning)',
            embedder_key=f'onoff-{mode}-v1', dim=a.shape[1]))
