"""The commands of ``anytime``: one module per verb, the only code that parses arguments and prints.

Each command's module has a docstring, ``SUMMARY`` (its line in ``anytime --help``), ``add_arguments(parser)``
(its options, on the sub-parser :mod:`anytime.cli` gives it) and ``run(args) -> int`` (the exit status). Options
that several commands take are declared once, in :mod:`anytime.commands.options`; the printing they share is in
:mod:`anytime.commands.output`. The library below never prints: it returns results, raises
:class:`~anytime.errors.AnytimeError`, and reports progress through the callbacks a command passes it.

Imports: ``anytime COMMAND --help`` imports the command's module, so a module imports at its top only what loads
in milliseconds (the standard library, these helpers, the light parts of the package); whatever brings in torch,
numpy, matplotlib or a web server is imported inside ``run``, where the work starts.
"""
