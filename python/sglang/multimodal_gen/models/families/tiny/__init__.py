"""Tiny random-weight models of each family (``ModelFamily.build_tiny``): written with the
reference libraries' own classes and saved in the real on-disk format, for tests, benchmarks
and the default model of a family without an embedded one. ``common`` holds what several
builders share (offline tokenizers, parameter redraws)."""
