"""``python -m kvtier.tools.kvperf`` runs the ``kvperf`` command."""
from .cli import main

main()
