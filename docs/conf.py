"""Sphinx configuration of the sdm_jax docs: MyST pages, executed MyST notebooks (myst-nb), and an
API and config reference generated from the code (`_ext/sdm_docs.py`).

Build from the repository root:

    pip install -e '.[docs]' -c requirements.txt
    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import os
import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path[:0] = [str(ROOT), str(DOCS / "_ext")]  # experiments/ and launch/ are folders of the repository
# The executed pages run from the repository root, as the README's commands do (their kernels
# start with this environment).
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

project = "sdm_jax"
author = "sdm_jax authors"
copyright = "the sdm_jax authors"

extensions = [
  "myst_nb",
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sdm_docs",
]

exclude_patterns = ["_build", "_ext", "_generated", "**.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb"}

# Docstrings: `name` is a link where it names something documented, else code.
default_role = "py:obj"
# A reference to a name of this project that does not resolve is an error (with -W); references to
# other libraries' names (jax.Array, optax's types) are left as text.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!sdm_jax\.).*"), (r"py:.*", r".*\._\w+.*")]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # a NamedTuple's `Attributes:` as fields, not a second description of each

myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 3

# Every code cell of every MyST notebook runs at every build; an error fails it.
nb_execution_mode = "force"
nb_execution_raise_on_error = True
nb_execution_timeout = 300
nb_execution_show_tb = True
nb_merge_streams = True

html_theme = "sphinx_book_theme"
html_title = "sdm_jax"
html_theme_options = {
  "show_toc_level": 2,
  "home_page_in_toc": True,
}
