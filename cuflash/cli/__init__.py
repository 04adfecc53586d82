"""The command line's subcommands (python -m cuflash COMMAND): the top layer, imported by nothing in the package."""
