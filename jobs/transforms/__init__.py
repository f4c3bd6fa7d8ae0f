"""Pure DataFrame -> DataFrame transforms of sluice pipelines.

Each takes the epoch's valid records (the spec's schema) and the pipeline's reference tables,
and returns the DataFrame for its sink (or a dict sink name -> DataFrame). They read and write
nothing themselves, so the same function runs as a batch job over all files.
"""
