"""A private single-node Slurm for tests and trials (:mod:`launch.slurm.testbed`; docs/cluster.md)."""
