"""The ``schedspec`` command line: thin subcommands over library calls (``main.main``)."""
