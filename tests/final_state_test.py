"""final_state.npz: the built-in models' arrays and a user network's nested counters round-trip."""

import types

import numpy as np

from sdm_jax.runs import final_state


def test_a_network_s_nested_counters_and_params_round_trip(tmp_path):
  states = types.SimpleNamespace(
    params={"conv": {"kernel": np.ones((2, 3, 3, 1, 4))}, "layers": {"0": {"bias": np.arange(6.0).reshape(2, 3)}}},
    gaba_counts={
      "sdm": {"counts": np.arange(10.0).reshape(2, 5)},
      "drop": {"rngs": {"key": np.ones((2, 2), np.uint32)}},
    },
    epoch=np.array([4, 4]),
  )
  final_state.save(tmp_path / "f.npz", states, [0, 1], data={"source": "x"})
  loaded = final_state.load(tmp_path / "f.npz")
  assert "counters/sdm/counts" in loaded.names and "gaba_counts" not in loaded.names
  np.testing.assert_array_equal(loaded.gaba_counts["sdm"]["counts"], states.gaba_counts["sdm"]["counts"])
  assert loaded.gaba_counts["drop"]["rngs"]["key"].dtype == np.uint32
  np.testing.assert_array_equal(loaded.params["layers"]["0"]["bias"], states.params["layers"]["0"]["bias"])
  assert loaded.data == {"source": "x"} and list(loaded.seeds) == [0, 1]


def test_the_built_in_models_arrays_keep_their_keys(tmp_path):
  states = types.SimpleNamespace(params={"hidden": {"kernel": np.ones((1, 3, 2))}}, gaba_counts=np.zeros((1, 2)))
  final_state.save(tmp_path / "f.npz", states, [7])
  loaded = final_state.load(tmp_path / "f.npz")
  assert loaded.names == {"seeds", "gaba_counts", "params/hidden/kernel"} and loaded.epoch is None
  np.testing.assert_array_equal(loaded.gaba_counts, np.zeros((1, 2)))
