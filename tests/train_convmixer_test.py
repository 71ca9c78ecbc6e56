"""Tests of experiments.train_convmixer: config checks, a tiny run, resume, the saved embedder."""

import json

import jax
import pytest

from experiments import train_convmixer
from experiments.configs import convmixer as convmixer_config


def tiny_config(**overrides):
  c = convmixer_config.get_config('tiny')
  c.dataset = 'cifar10'  # TFDS, run on tfds.testing.mock_data
  c.dim, c.depth, c.batch_size, c.eval_batch_size = 8, 1, 16, 16
  c.max_train_examples = c.max_test_examples = 0
  c.randaugment_ops = 1
  c.log_every_steps = 1
  for k, v in overrides.items():
    c[k] = v
  return c


def run_tiny(workdir, **overrides):
  tfds = pytest.importorskip('tensorflow_datasets')
  with tfds.testing.mock_data(num_examples=32):
    return train_convmixer.train_and_evaluate(tiny_config(**overrides), workdir)


def test_variants_and_reference_recipe():
  full = convmixer_config.get_config('full')
  assert (full.dim, full.depth, full.kernel_size, full.patch_size) == (256, 8, 5, 2)
  assert (full.lr, full.weight_decay, full.batch_size, full.clip_norm) == (0.01, 0.005, 512, 1.0)
  assert full.lr_schedule == 'constant' and full.dataset == 'imagenet32'
  assert (full.randaugment_ops, full.randaugment_magnitude, full.flip) == (2, 12, True)
  assert convmixer_config.get_config('quick').dataset == 'cifar10_jpeg'
  assert convmixer_config.get_config('quick,cifar10').dataset == 'cifar10'
  with pytest.raises(ValueError, match='bogus'):
    convmixer_config.get_config('bogus')


@pytest.mark.parametrize(
  'field,value,match',
  [
    ('batch_size', 0, 'config.batch_size'),
    ('lr_schedule', 'cosine', 'config.lr_schedule'),
    ('patch_size', 3, 'config.patch_size'),
    ('randaugment_magnitude', 31, 'config.randaugment_magnitude'),
    ('num_devices', 64, 'config.num_devices'),
  ],
)
def test_config_errors_name_the_field(field, value, match):
  c = tiny_config(**{field: value})
  with pytest.raises(ValueError, match=match):
    train_convmixer.validate_config(c, jax.device_count())


def test_batch_must_split_over_devices():
  with pytest.raises(ValueError, match='config.batch_size .* multiple of the device count 3'):
    train_convmixer.validate_config(tiny_config(batch_size=16), 3)


@pytest.mark.slow
def test_tiny_run_writes_results_and_embedder_then_resumes(tmp_path):
  results = run_tiny(tmp_path, epochs=1)
  saved = json.loads((tmp_path / 'results.json').read_text())
  assert saved['epochs'] == 1 and saved['steps'] == 2 and saved['lossy'] is False
  assert 0.0 <= saved['test_accuracy'] <= 1.0
  assert saved['dataset_source'].startswith('tfds:cifar10')
  assert saved['params'] == results['params'] > 0
  model, variables, meta = train_convmixer.load_embedder(tmp_path)
  assert meta['num_classes'] == 10 and meta['config']['dim'] == 8
  assert set(variables) == {'params', 'variables'} and model.num_classes == 10
  # Rerunning the same config resumes from the last checkpoint (here: nothing left to train).
  again = run_tiny(tmp_path, epochs=1)
  assert again['history'] == saved['history']
  # A different config (the LR schedule depends on the epoch count) does not silently resume.
  with pytest.raises(ValueError, match='epochs'):
    run_tiny(tmp_path, epochs=2)


def test_missing_embedder_says_how_to_train_one(tmp_path):
  with pytest.raises(FileNotFoundError, match='train_convmixer'):
    train_convmixer.load_embedder(tmp_path)
