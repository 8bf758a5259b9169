"""What the tests share that is not a test: launchers (torchrun, train.py in a subprocess), the scripts those launch
on several ranks (*_harness.py, *_probe.py), debug-model training, NaN injection, and readers of what runs write.
tests/ is on the path (pyproject.toml's pytest pythonpath), so tests import these as `harness.<module>`."""
