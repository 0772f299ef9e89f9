"""Console scripts beside the launcher and the built-in loop: trainer-scale, trainer-export, trainer-report."""
