"""The ``kvtier`` command line: the composition root.

It composes ``kvtier.policies`` in beside the core (:func:`kvtier.cli.main.compose`) and
imports the other parts (daemon, benchmarks, calculator) lazily, per command.
"""
