"""The `fsdpzero` command line (main.py dispatches; one module a command). The library never imports this wing."""
from fsdpzero.cli.main import main  # noqa: F401
