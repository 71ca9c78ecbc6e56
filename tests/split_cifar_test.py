"""experiments.configs.pretrain / split_cifar; the train_convmixer -> embed -> pretrain -> split_cifar chain."""

import json
import types

import numpy as np
import pytest

from experiments.configs import pretrain, split_cifar
from sdm_jax import data as data_lib
from sdm_jax.runs import final_state
from experiments import driver, schema
from sdm_jax.data import embeddings


# The chains below train with the dense step only: which step trains after the GABA switch is not what
# they claim (a pipeline, a refusal, a file's contents), and "auto" compiles the sparse step as well;
# the sparse step is checked against the dense one in sparse_test, mlp_test and continual_test.
_STEP = "dense"


def _fake_dataset(num_classes, dim=256, per_class=12, test_per_class=4, seed=0, lossy=True):
  """Separable float32 features, one Gaussian blob per class (stands in for embeddings)."""
  rng = np.random.default_rng(seed)
  means = rng.normal(size=(num_classes, dim)).astype(np.float32)

  def split(n):
    y = np.repeat(np.arange(num_classes), n).astype(np.int32)
    return (means[y] + 0.3 * rng.normal(size=(len(y), dim))).astype(np.float32), y

  (tx, ty), (vx, vy) = split(per_class), split(test_per_class)
  return dict(
    train_images=tx,
    train_labels=ty,
    test_images=vx,
    test_labels=vy,
    lossy=lossy,
    source="synthetic embeddings" + (" (LOSSY JPEG stand-in)" if lossy else ""),
  )


@pytest.fixture
def fake_data(monkeypatch):
  """load_dataset(name, data_dir): data_dir "imagenet:C" gives C classes, anything else CIFAR-10's 10."""

  def load(name, data_dir=None, **kwargs):
    classes = int(data_dir.split(":")[1]) if data_dir and data_dir.startswith("imagenet:") else 10
    classes = 100 if data_dir == "cifar100" else classes
    return _fake_dataset(classes)

  monkeypatch.setattr(data_lib, "load_dataset", load)


@pytest.mark.parametrize("size", split_cifar.SIZES)
def test_every_row_and_pretrain_validates(size):
  for variant in pretrain.VARIANTS:
    schema.validate_config(pretrain.get_config(f"{variant},{size}"))
  for variant in split_cifar.VARIANTS:
    config = split_cifar.get_config(f"{variant},{size}")
    if config.pretrain_variant:
      assert config.pretrain_variant in pretrain.ROWS
      config.pretrained = "/some/pretrain"
    schema.validate_config(config)


def test_reference_settings():
  p = pretrain.get_config("sdmlp")
  assert (p.epochs_per_task, p.model.gaba_switch_activations, p.optimizer.name, p.optimizer.learning_rate) == (
    300,
    5e5,
    "sgdm",
    0.03,
  )
  assert p.classes_per_task == p.num_classes == 1000 and p.model.input_size == 256
  px = pretrain.get_config("pixels_sdmlp_10k")
  assert (px.epochs_per_task, px.model.gaba_switch_activations, px.model.input_size, px.dataset) == (
    100,
    1e7,
    3072,
    "imagenet32",
  )
  assert pretrain.get_config("topk").model.k_transition_epochs == 50
  c = split_cifar.get_config("sdmlp")
  assert (c.epochs_per_task, c.optimizer.name, c.optimizer.learning_rate, c.batch_size) == (2000, "sgd", 0.05, 128)
  assert c.model.gaba_switch_activations == 5e5 and c.pretrain_variant == "sdmlp"  # T inherited from the pretrain
  assert c.seeds == (0, 3, 15, 27, 97) and c.class_order == "reference"
  e = split_cifar.get_config("sdmlp_ewc_10k")
  assert (
    e.optimizer.name,
    e.optimizer.learning_rate,
    e.regularizer.method,
    e.regularizer.strength,
    e.regularizer.beta,
    e.model.neurons,
    e.model.k,
  ) == ("sgdm", 0.03, "ewc", 100.0, 0.08, 10_000, 10)
  assert split_cifar.get_config("nopretrain_sdmlp_ewc").optimizer.name == "sgd"  # no pretraining: SGD for all
  assert split_cifar.get_config("nopretrain_sdmlp_k1").model.gaba_switch_activations == 5e6
  assert split_cifar.get_config("nopretrain_sdmlp_k1,quick").model.gaba_switch_activations == 5e5
  h = split_cifar.get_config("cifar100_sdmlp")
  assert (h.num_classes, h.classes_per_task, h.epochs_per_task, len(h.seeds)) == (100, 2, 500, 3)
  assert split_cifar.get_config("pixels_sdmlp_ewc").model.input_size == 3072
  assert split_cifar.get_config("oracle").classes_per_task == 10
  assert split_cifar.get_config("dropout").model.dropout == 0.03
  # Pretrained rows keep the pretrain's T when the schedule is shortened; others scale it.
  assert split_cifar.with_epochs_per_task(c, 20).model.gaba_switch_activations == 5e5
  n = split_cifar.with_epochs_per_task(split_cifar.get_config("nopretrain_pixels_sdmlp"), 20)
  assert n.model.gaba_switch_activations == 5e4 and n.epochs_per_task == 20


def test_every_table_row_has_the_papers_value():
  rows = [r for rows in split_cifar.TABLE_ROWS.values() for r in rows]
  assert len(rows) == len(set(rows)) == 21 + 7 + 9 + 13
  for row in rows:
    assert split_cifar.get_config(row).paper_final_accuracy == split_cifar.PAPER_FINAL_ACCURACY[row]


def test_pretrained_row_without_a_checkpoint_is_refused(tmp_path):
  with pytest.raises(ValueError, match=r"config\.pretrained: this row starts from the pretrain 'sdmlp'"):
    driver.train_and_evaluate(split_cifar.get_config("sdmlp,tiny"), tmp_path / "run")
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_cifar100_fifty_tasks_compile_once(tmp_path, fake_data, caplog, count_compiles):
  """50 tasks of 2 classes: the padded tasks share one shape, so the training block compiles once."""
  config = split_cifar.get_config("nopretrain_sdmlp_k1,tiny")
  config.data_dir = "cifar100"
  config.num_classes = config.model.num_classes = 100
  config.model.neurons, config.epochs_per_task, config.eval_every = 32, 1, 1
  config.seeds, config.checkpoint_every_epochs, config.train_step = (3,), 1000, "dense"
  config.batch_size = 8  # at most a task's 24 examples
  # the seed-lifted blocks (train.over_seeds)
  results, compiled = count_compiles(lambda: driver.train_and_evaluate(config, tmp_path), "Compiling jit(mapped)")
  assert np.array(results["per_seed"][0]["acc_matrix"]).shape == (50, 50)
  assert len(compiled) == 2, compiled  # the training block and the evaluation, once each
  assert results["dataset"]["lossy"] and "LOSSY stand-in" in caplog.text  # a lossy source says so


def test_tables_for_reproduce():
  """experiments.reproduce reads TABLE_ROWS / TABLE_TITLES (not imported here: its flags would clash
  with experiments.embed's in one test process)."""
  assert set(split_cifar.TABLE_TITLES) == set(split_cifar.TABLE_ROWS)
  for rows in split_cifar.TABLE_ROWS.values():
    assert set(rows) <= set(split_cifar.ROWS)


def test_embedding_width_is_checked_against_the_file(tmp_path, fake_data):
  config = split_cifar.get_config("nopretrain_sdmlp,tiny")
  config.model.input_size = 128  # the fake embeddings are 256-d
  with pytest.raises(ValueError, match=r"config\.model\.input_size: 128 does not match the 256 features"):
    driver.train_and_evaluate(config, tmp_path)


@pytest.mark.slow
def test_whole_chain_train_convmixer_embed_pretrain_split_cifar(tmp_path):
  """Issue 5's chain on TFDS mock data: ConvMixer -> embeddings -> SDMLP pretrain -> Split CIFAR-10.

  CIFAR-100 stands in for ImageNet32 as the pretraining set (the mock has no ImageNet32 files).
  """
  tfds = pytest.importorskip("tensorflow_datasets")
  from experiments import embed, train_convmixer
  from experiments.configs import convmixer as convmixer_config

  c = convmixer_config.get_config("tiny")
  c.dataset, c.dim, c.depth, c.batch_size, c.eval_batch_size, c.epochs = "cifar10", 8, 1, 50, 50, 1
  c.max_train_examples = c.max_test_examples = 0
  with tfds.testing.mock_data(num_examples=100):
    train_convmixer.train_and_evaluate(c, tmp_path / "convmixer")
    pre_file, _ = embed.embed_dataset(tmp_path / "convmixer", "cifar100", tmp_path / "pre.npz")
    cifar_file, _ = embed.embed_dataset(tmp_path / "convmixer", "cifar10", tmp_path / "cifar10.npz")

  pre = pretrain.get_config("sdmlp,tiny")
  pre.data_dir, pre.model.input_size, pre.model.neurons = str(pre_file), 8, 32
  pre.num_classes = pre.classes_per_task = pre.model.num_classes = 100
  pre.batch_size = 16  # the mock's 100 examples
  pre.train_step = _STEP
  driver.train_and_evaluate(pre, tmp_path / "pretrain")
  _, _, pre_counts = final_state.load(tmp_path / "pretrain" / "final_state.npz")[:3]

  config = split_cifar.get_config("sdmlp,tiny")
  config.data_dir, config.pretrained, config.seeds = str(cifar_file), str(tmp_path / "pretrain"), (0, 3)
  config.model.input_size, config.model.neurons, config.batch_size = 8, 32, 8
  config.train_step = _STEP
  results = driver.train_and_evaluate(config, tmp_path / "split_cifar")
  assert results["status"] == "finished" and results["tasks_finished"] == 5
  assert results["pretrained"] == str(tmp_path / "pretrain" / "final_state.npz")
  assert "embeddings" in results["dataset"]["source"] and not results["dataset"]["lossy"]
  assert results["dataset"]["identity"]["embedder_key"] == embed.embedder_key(tmp_path / "convmixer")  # checked
  assert [s["class_order"] for s in results["per_seed"]] == [list(range(10)), [5, 4, 1, 2, 9, 6, 7, 0, 3, 8]]
  _, params, counts = final_state.load(tmp_path / "split_cifar" / "final_state.npz")[:3]
  assert params["output"]["kernel"].shape == (2, 32, 10)  # X_v: a fresh 10-way layer per seed
  assert np.all(counts >= pre_counts) and pre_counts.sum() > 0  # the GABA counters carried on
  with np.load(tmp_path / "split_cifar" / "final_state.npz") as f:
    assert f["epoch"].tolist() == [2 + 10, 2 + 10]  # the pretrain's 2 epochs + 5 tasks x 2


@pytest.mark.slow
def test_pixel_rows_imagenet32_pretrain_then_split_cifar10_through_tfds(tmp_path):
  """Table 3's path on TFDS mock data: an ImageNet32-pixel pretrain (TFDS imagenet_resized/32x32, 3072
  inputs), then a pixel row of Split CIFAR-10 (TFDS cifar10) starting from it."""
  tfds = pytest.importorskip("tensorflow_datasets")
  with tfds.testing.mock_data(num_examples=20):
    pre = pretrain.get_config("pixels_sdmlp_k1,tiny")
    pre.model.neurons, pre.batch_size, pre.train_step = 16, 4, _STEP  # the mock's 20 examples
    pre_results = driver.train_and_evaluate(pre, tmp_path / "pretrain")
  # Split CIFAR-10 needs every class in its training data (a task would train on nothing): the
  # mock's 20 random labels leave class 6 out, 100 give every class.
  with tfds.testing.mock_data(num_examples=100):
    config = split_cifar.get_config("pixels_sdmlp_k1,tiny")
    config.model.neurons, config.pretrained, config.seeds = 16, str(tmp_path / "pretrain"), (3,)
    config.batch_size, config.train_step = 4, _STEP
    results = driver.train_and_evaluate(config, tmp_path / "split_cifar")
  assert pre_results["dataset"]["source"] == "tfds:imagenet_resized/32x32"
  assert results["dataset"]["source"] == "tfds:cifar10" and results["tasks_finished"] == 5
  assert results["pretrained"] == str(tmp_path / "pretrain" / "final_state.npz")
  _, params, _ = final_state.load(tmp_path / "split_cifar" / "final_state.npz")[:3]
  assert params["hidden"]["kernel"].shape == (1, 3072, 16) and params["output"]["kernel"].shape == (1, 16, 10)


def _embedding_file(path, key, num_classes=10, dim=8):
  """A small embedding file as experiments.embed writes it; key None: an older or hand-made file (no key)."""
  ds = _fake_dataset(num_classes, dim=dim, lossy=False)
  meta = dict(
    dataset=path.stem,
    dataset_source="synthetic",
    lossy=False,
    embedder="/convmixer",
    dim=dim,
    num_classes=num_classes,
    embedder_key=key,
  )
  if key is None:
    del meta["embedder_key"]
    np.savez(
      path, **{k: ds[k] for k in ("train_images", "train_labels", "test_images", "test_labels")}, meta=json.dumps(meta)
    )
    return path
  return embeddings.save_embeddings(
    path,
    train_embeddings=ds["train_images"],
    train_labels=ds["train_labels"],
    test_embeddings=ds["test_images"],
    test_labels=ds["test_labels"],
    meta=meta,
  )


def _split(data_file, pretrain_dir, workdir):
  """A one-epoch-per-task Split CIFAR-10 run of 16 neurons on 8-d embeddings from `pretrain_dir`."""
  config = split_cifar.get_config("sdmlp,tiny")
  config.data_dir, config.pretrained, config.seeds = str(data_file), str(pretrain_dir), (0,)
  config.model.input_size, config.model.neurons, config.batch_size = 8, 16, 8  # tasks of 24 examples
  config.epochs_per_task = config.eval_every = 1
  config.train_step = _STEP
  return driver.train_and_evaluate(config, workdir)


def _pretrain_config(data_file):
  pre = pretrain.get_config("sdmlp,tiny")
  pre.data_dir = str(data_file)
  pre.model.input_size, pre.model.neurons, pre.seeds, pre.batch_size = 8, 16, (0,), 8
  pre.num_classes = pre.classes_per_task = pre.model.num_classes = 10
  pre.epochs_per_task = pre.eval_every = 1
  pre.train_step = _STEP
  return pre


@pytest.mark.slow
def test_pretrain_records_its_embedder_and_split_cifar_refuses_another(tmp_path):
  """A retrained embedder (new key) with an old pretrain is refused; embeddings from the same one run."""
  driver.train_and_evaluate(
    _pretrain_config(_embedding_file(tmp_path / "imagenet32.npz", "aaa111")), tmp_path / "pretrain"
  )
  with np.load(tmp_path / "pretrain" / "final_state.npz") as f:
    assert json.loads(str(f["data"]))["embedder_key"] == "aaa111"
  with pytest.raises(
    ValueError,
    match=r"(?s)config\.pretrained: .*pretrain/final_state\.npz was pretrained on "
    r".*imagenet32\.npz \(embedder key aaa111\), but config\.data_dir .*cifar10_new\.npz was "
    r"embedded by another embedder \(key bbb222\).*experiments\.embed",
  ):
    _split(_embedding_file(tmp_path / "cifar10_new.npz", "bbb222"), tmp_path / "pretrain", tmp_path / "refused")
  assert not (tmp_path / "refused").exists()  # refused before anything was written
  results = _split(_embedding_file(tmp_path / "cifar10.npz", "aaa111"), tmp_path / "pretrain", tmp_path / "same")
  assert results["tasks_finished"] == 5 and results["dataset"]["identity"]["embedder_key"] == "aaa111"


@pytest.mark.slow
def test_embedding_file_without_a_key_runs_unchecked_and_says_so_once(tmp_path, caplog):
  """Older or hand-made files keep working with a keyed pretrain (here written directly, as a pretrain
  run leaves it: final_state.npz with its data's identity, and config.json)."""
  pre = _pretrain_config(tmp_path / "imagenet32.npz")
  rng = np.random.default_rng(0)
  states = types.SimpleNamespace(
    params={
      "hidden": {"kernel": rng.random((1, 8, 16), np.float32)},
      "output": {"kernel": rng.random((1, 16, 10), np.float32)},
    },
    gaba_counts=np.zeros((1, 16), np.float32),
    epoch=np.ones((1,), np.int32),
  )
  (tmp_path / "pretrain").mkdir()
  final_state.save(
    tmp_path / "pretrain" / "final_state.npz", states, (0,), data=dict(file=pre.data_dir, embedder_key="aaa111")
  )
  (tmp_path / "pretrain" / "config.json").write_text(pre.to_json_best_effort())
  results = _split(_embedding_file(tmp_path / "cifar10_old.npz", None), tmp_path / "pretrain", tmp_path / "run")
  assert results["tasks_finished"] == 5 and "sha256" in results["dataset"]["identity"]
  assert caplog.text.count("embedder not checked: the pretrain") == 1
