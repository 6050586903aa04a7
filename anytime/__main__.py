"""``python -m anytime`` is the same as the ``anytime`` command."""

from anytime.cli import main

raise SystemExit(main())
