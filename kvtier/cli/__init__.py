"""The ``kvtier`` command line: the composition root; imports the rest lazily, per command."""
