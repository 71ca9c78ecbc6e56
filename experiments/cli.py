"""The one absl main behind `experiments.split_mnist`, `.split_cifar` and `.pretrain`.

Each of those modules is `cli.main(default_config, default_workdir)`: a
`--config` file with its variant (overridable field by field,
`--config.FIELD=VALUE`) and a `--workdir`, run by
`experiments.driver.train_and_evaluate`.
"""

from absl import app, flags
from ml_collections import config_flags

from experiments import driver


def main(default_config: str, default_workdir: str) -> None:
  """Defines --config and --workdir with these defaults, parses the command line and runs."""
  config = config_flags.DEFINE_config_file(
    "config", default_config, "Config file and variant, e.g. file.py:sdmlp,quick."
  )
  workdir = flags.DEFINE_string("workdir", default_workdir, "Where the run writes (and resumes from).")

  def run(argv):
    if len(argv) > 1:
      raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    driver.train_and_evaluate(config.value, workdir.value)

  app.run(run)
