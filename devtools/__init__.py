"""Tools of the tests, benchmarks and examples (not installed with hvd_scalecom): :mod:`devtools.launch`
starts ``horovodrun`` jobs, :mod:`devtools.timeline` reads Horovod timelines. Import them with the
repository's root on ``sys.path`` (``python -m benchmarks.x`` from the root does that)."""
