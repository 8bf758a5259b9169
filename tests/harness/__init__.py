"""What the tests share that is not a test: the one model builder (models.py) and the one trainer builder
(debug_training.py), launchers (torchrun, train.py in a subprocess), the scripts those launch on several ranks
(*_harness.py, *_probe.py), NaN injection, and readers of what runs write (tests/README.md lists every module).
tests/ is on the path (pyproject.toml's pytest pythonpath), so tests import these as `harness.<module>`."""
