"""Entry points: python -m experiments.<name>."""
