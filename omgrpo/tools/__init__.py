"""Developer tools on top of the library: benchmarks and the TRL peer they compare with."""
