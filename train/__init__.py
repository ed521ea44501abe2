"""The training CLI: `python -m train ...`, `python -m train compare ...`, `python -m train.bench ...`."""
