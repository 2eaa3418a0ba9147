"""``qwz-qualify matrix SPEC --out DIR``: a qualification matrix, one ``run`` per cell.

``matrix_spec.py`` reads the TOML spec and expands it into cells (the file's format is in its
docstring); ``cells.py`` runs every cell as its own ``python -m qwz.qualify run``
subprocess into ``DIR/cells/<cell id>/``, resumes a matrix that was stopped, and writes
``DIR/matrix.md`` and ``DIR/matrix.json`` (the table itself is qualify/review/matrix.py's,
so ``compare`` and ``report`` read it without this package).
"""
