"""Networks a config names by import path (`config.model.network`), as a user's own would be.

Synopsis::

    python -m experiments.split_mnist --config=experiments/configs/split_mnist.py:cnn_sdm,quick --workdir=DIR
    # or any module of yours: --config.model.kind=network --config.model.network=mypackage.nets:MyNet

`SmallCNN` is the SDM layer guide's CNN (docs/guide/sdm_layer.md, "One complete recipe"): a strided
convolution, then either the SDM head (`Center`, the SDM layer with the GABA switch,
`normalize_output`, a readout without bias) or a ReLU head of the same width. The engine calls
`SmallCNN(**config.model.network_args, rngs=rngs)` once per seed and trains it through the paper's
class-incremental protocol (`sdm_jax.engine.networks`).
"""

from __future__ import annotations

from flax import nnx
import jax

import sdm_jax
from sdm_jax.core import centering

#: The heads `SmallCNN` takes.
HEADS = ("sdm", "relu")


class SmallCNN(nnx.Module):
  """Conv trunk -> SDM head (Center -> SDM -> normalize_output -> readout) or ReLU head.

  Args:
    head: "sdm" or "relu" (an `nnx.Linear` with ReLU, the same width, and a readout with bias).
    channels: the convolution's feature maps (3x3, stride 2: 28x28 -> 14x14).
    neurons: the head's units r.
    k: the SDM layer's k (App. B.3's k_target).
    switch_epochs: GABA's T in epochs of `dataset_size` examples (T = switch_epochs x dataset_size).
    dataset_size: the examples of one epoch of the first task (Split MNIST: about 12,000).
    output_scale: `normalize_output`'s scale (the readout sees |a*| = this; 0: a* as it is).
    center: put `Center` (a running mean of the trunk's features) before the SDM layer.
    image_shape: one example's (height, width[, channels]) as the dataset stores it.
    num_classes: the logits' width.
    rngs: `nnx.Rngs`.
  """

  def __init__(
    self,
    *,
    head: str = "sdm",
    channels: int = 8,
    neurons: int = 1000,
    k: int = 100,
    switch_epochs: float = 1.0,
    dataset_size: int = 12_000,
    output_scale: float = 10.0,
    center: bool = True,
    image_shape: tuple[int, ...] = (28, 28),
    num_classes: int = 10,
    rngs: nnx.Rngs,
  ):
    if head not in HEADS:
      raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    in_channels = image_shape[2] if len(image_shape) == 3 else 1
    features = channels * -(-image_shape[0] // 2) * -(-image_shape[1] // 2)
    self.head, self.output_scale = head, output_scale
    self.conv = nnx.Conv(in_channels, channels, (3, 3), strides=(2, 2), rngs=rngs)
    if head == "sdm":
      self.center = centering.Center(features, momentum=0.99) if center else None
      self.sdm = sdm_jax.SDM(features, neurons, k=k, switch_epochs=switch_epochs, dataset_size=dataset_size, rngs=rngs)
      self.out = nnx.Linear(neurons, num_classes, use_bias=False, rngs=rngs)
    else:
      self.hidden = nnx.Linear(features, neurons, rngs=rngs)
      self.out = nnx.Linear(neurons, num_classes, rngs=rngs)

  def __call__(self, images: jax.Array) -> jax.Array:
    """Logits [batch, num_classes] of images [batch, height, width(, channels)] in [0, 1]."""
    if images.ndim == 3:
      images = images[..., None]
    h = nnx.relu(self.conv(images)).reshape(len(images), -1)
    if self.head == "relu":
      return self.out(nnx.relu(self.hidden(h)))
    a_star = self.sdm(self.center(h) if self.center is not None else h)
    if self.output_scale:
      a_star = centering.normalize_output(a_star, scale=self.output_scale)
    return self.out(a_star)
