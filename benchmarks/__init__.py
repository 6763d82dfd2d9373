"""Collective and overhead benchmarks of the gang packages (run them with ``nox -s bench``)."""
