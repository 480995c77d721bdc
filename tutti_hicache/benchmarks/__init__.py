"""Benchmarks shipped with the package (the way kvikio ships its own): the pure parts of the
end-to-end server benchmark (`e2e`: workload, summaries, reports), importable from the runner
scripts in the repository's bench/ folder and from the tests alike."""
