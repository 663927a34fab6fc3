"""The bundled recipes: ``python -m jodpo.train --config NAME.py`` finds them by name from any directory, after any
install. Each file defines ``get_config()``; they are read by path (``jodpo.program.config.load_config_file``),
not imported."""
