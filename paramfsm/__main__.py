"""``python -m paramfsm``: the same command line as the ``paramfsm`` script."""

from paramfsm.cli import main

raise SystemExit(main())
