"""Console scripts beside the launcher: trainer-scale, trainer-export, trainer-report."""
