"""Winner spread and h range of a finished probe: python hrange.py WORKDIR DATA(onoff|raw)"""
import os, sys, numpy as np
from sdm_jax import data
z = np.load(sys.argv[1] + '/final_state.npz', allow_pickle=True)
W = z['params/hidden/kernel'][0]
if sys.argv[2] == 'onoff':
  x = np.load(os.path.join(os.environ.get('PROBE_DIR', '/tmp/pixprobe'), 'onoff_dataset.npz'))['test_images'][:2000]
else:
  x = data.load_dataset('cifar10_jpeg')['test_images'][:2000].reshape(2000, -1).astype(np.float32) / 255
x = x / np.linalg.norm(x, axis=1, keepdims=True)
a = x @ W; order = np.argsort(-a, axis=1); s = np.take_along_axis(a, order, 1)
counts = np.bincount(order[:, :10].ravel(), minlength=W.shape[1])
print(sys.argv[1], 'a1-a11 %.4f' % (s[:, 0] - s[:, 10]).mean(), 'sum h %.4f' % np.maximum(a - s[:, 10:11], 0).sum(1).mean(),
      'distinct winners', (counts > 0).sum(), 'top-10 share %.2f' % (np.sort(counts)[::-1][:10].sum() / counts.sum()))
