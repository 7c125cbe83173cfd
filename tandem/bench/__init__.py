"""The benchmark: workloads, runs on one engine, and the `tandem bench` report."""
