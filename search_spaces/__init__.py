"""The built-in search spaces (``--space default``, ``--space smoke``, ...).

These YAML files ship inside the package as ``autotune.search_spaces`` (see
``pyproject.toml``), so an installed wheel finds them from any folder.
"""
